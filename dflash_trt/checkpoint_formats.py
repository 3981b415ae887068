"""TensorRT-LLM checkpoints (config.json + rank{r}.safetensors) and ModelOpt's unified quantized-HF
format, for our targets and the DFlash drafter: tensor names, per-rank shapes, config.json, and the
way back (a rank's tensors under Hugging Face names, dequantized) for the reference runtime.

Where the facts come from (checked against nvidia-modelopt 0.47's `export_tensorrt_llm_checkpoint`
and `export_hf_checkpoint` on CPU, which tests/test_convert_modelopt.py runs as the oracle):
- names: `tensorrt_llm/models/llama/convert.py` and `models/qwen/convert.py` (TensorRT-LLM), modelopt's
  `export/layer_utils.py`: fused `attention.qkv` [Q|K|V], `attention.dense`, GatedMLP `mlp.fc` (HF
  gate_proj, the activated branch), `mlp.gate` (HF up_proj), `mlp.proj`; Qwen3's per-head norms are
  `attention.q_layernorm` / `attention.k_layernorm` with `qk_layernorm: true`;
- scales: `weights_scaling_factor` (+ `_2` for NVFP4), `activation_scaling_factor`,
  `attention.{kv,k,v}_cache_scaling_factor`; FP8 scalars have shape (1,), NVFP4 scalars shape ();
  fused groups (q/k/v, and fc/gate, which trtllm-build may merge into one GEMM) share the weight's
  global amax and the input amax (`preprocess_linear_fusion`, modelopt export/quant_utils.py);
- quantized HF: `weight`, `weight_scale`, `weight_scale_2`, `input_scale`, `k_proj.k_scale`,
  `v_proj.v_scale` (scalars of shape ()) and `hf_quant_config.json`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from . import shard_rules
from .checkpoint import InMemorySource, SafetensorsCheckpoint
from .safetensors_io import SafetensorsFile, SafetensorsWriter
from .config import (
    DRAFTER_ARCHITECTURE,
    TARGET_ARCHITECTURES,
    DrafterConfig,
    TargetConfig,
    TransformerConfig,
    parse_drafter_config,
    parse_target_config,
)
from .errors import CheckpointError, ConfigError
from .trtllm_config import (
    ENGINE_ARCHITECTURE,
    ENGINE_DRAFTER_PREFIX,
    TRTLLM_DRAFTER_ARCHITECTURE,
    TRTLLM_TARGET_ARCHITECTURES,
    engine_part_config,
    trtllm_drafter_as_hf,
    trtllm_target_as_hf,
)
from .quant import dequantize_fp8, dequantize_nvfp4
from .quant.mxfp4 import BLOCK as MXFP4_BLOCK
from .quant.mxfp4 import dequantize_mxfp4
from .quant.nvfp4 import BLOCK as NVFP4_BLOCK

QUANT_ALGOS = {"none": None, "fp8": "FP8", "nvfp4": "NVFP4"}
EXCLUDED_MODULES = ["lm_head"]  # embeddings and norms are never quantized; lm_head stays high precision
STR_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class Unit:
    """One output module: a linear (weight [+ bias] [+ scales]) or a plain tensor (norm, embedding, d2t).

    `sources` are HF module prefixes (linear) or tensor names (plain); `parts` say which part of a fused
    qkv each source is ("q", "k", "v"; "" otherwise). `split`: column | row | qkv | vocab | replicated.
    Members of one `group` share the weight's global scale and the activation scale."""

    out: str
    sources: tuple[str, ...]
    parts: tuple[str, ...]
    split: str
    linear: bool
    quantized: bool = False
    group: str | None = None
    bias: bool = False
    experts: int = 0  # > 0: a stack of this many experts, stored [experts, rows / experts, ...] (gpt-oss's MoE)

    @property
    def kind(self) -> str:
        return "linear" if self.linear else "plain"


@dataclass(frozen=True)
class KVUnit:
    """The KV-cache scales of one attention layer: `out` is the attention module's output prefix,
    `source` the calibration key of the layer's cache (K and V amax), `k_out`/`v_out` HF-format owners."""

    out: str
    source: str
    layer: int


# gpt-oss's experts as the converter reads them (ExpertView): per layer, virtual 2-D output-major tensors
# `{mlp}.experts.{gate,up,down}.weight` / `.bias` made from the module's fused, input-major, interleaved tensors.
EXPERT_PARTS = ("up", "gate", "down")
EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def _layer_units(prefix_in: str, prefix_out: str, cfg: TransformerConfig, fmt: str, quantize: bool, i: int) -> list[Unit]:
    a, m = f"{prefix_in}.self_attn", f"{prefix_in}.mlp"
    ab, mb = cfg.attention_bias, cfg.mlp_bias
    experts = getattr(cfg, "num_experts", 0)
    sinks = getattr(cfg, "attention_sinks", False)
    if fmt == "hf":
        units = [Unit(f"{prefix_in}.input_layernorm.weight", (f"{prefix_in}.input_layernorm.weight",), ("",), "replicated", False)]
        for p in ("q", "k", "v"):
            units.append(Unit(f"{a}.{p}_proj", (f"{a}.{p}_proj",), (p,), "replicated", True, quantize, f"{prefix_in}.attn", ab))
        if cfg.qk_norm:
            units += [Unit(f"{a}.{p}_norm.weight", (f"{a}.{p}_norm.weight",), ("",), "replicated", False) for p in ("q", "k")]
        if sinks:
            units.append(Unit(f"{a}.sinks", (f"{a}.sinks",), ("",), "replicated", False))
        units += [
            Unit(f"{a}.o_proj", (f"{a}.o_proj",), ("",), "replicated", True, quantize, None, ab),
            Unit(f"{prefix_in}.post_attention_layernorm.weight", (f"{prefix_in}.post_attention_layernorm.weight",), ("",), "replicated", False),
        ]
        if experts:
            # The module's own tensors, as ModelOpt's HF export keeps them (docs/research/modelopt-gpt-oss-hf-export.md):
            # the router never quantized; `gate_up_proj` [E, H, 2I] / `down_proj` [E, I, H] fused and input-major, each
            # quantized as one tensor (`experts` > 0 marks them: convert._ModelWriter writes them whole); biases as they are.
            units.append(Unit(f"{m}.router", (f"{m}.router",), ("",), "replicated", True, False, None, True))
            for t in EXPERT_TENSORS:
                stack = not t.endswith("_bias") and quantize
                units.append(Unit(f"{m}.experts.{t}", (f"{m}.experts.{t}",), ("",), "replicated", False, stack, None, False,
                                  experts if stack else 0))
            return units
        units += [
            Unit(f"{m}.gate_proj", (f"{m}.gate_proj",), ("",), "replicated", True, quantize, f"{prefix_in}.mlp", mb),
            Unit(f"{m}.up_proj", (f"{m}.up_proj",), ("",), "replicated", True, quantize, f"{prefix_in}.mlp", mb),
            Unit(f"{m}.down_proj", (f"{m}.down_proj",), ("",), "replicated", True, quantize, None, mb),
        ]
        return units
    o = prefix_out
    units = [
        Unit(f"{o}.input_layernorm.weight", (f"{prefix_in}.input_layernorm.weight",), ("",), "replicated", False),
        Unit(f"{o}.attention.qkv", (f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"), ("q", "k", "v"), "qkv", True, quantize, f"{o}.attention.qkv", ab),
    ]
    if cfg.qk_norm:
        units += [
            Unit(f"{o}.attention.q_layernorm.weight", (f"{a}.q_norm.weight",), ("",), "replicated", False),
            Unit(f"{o}.attention.k_layernorm.weight", (f"{a}.k_norm.weight",), ("",), "replicated", False),
        ]
    if sinks:  # one logit per query head: split with the heads
        units.append(Unit(f"{o}.attention.sinks", (f"{a}.sinks",), ("",), "column", False))
    units += [
        Unit(f"{o}.attention.dense", (f"{a}.o_proj",), ("",), "row", True, quantize, None, ab),
        Unit(f"{o}.post_layernorm.weight", (f"{prefix_in}.post_attention_layernorm.weight",), ("",), "replicated", False),
    ]
    if experts:
        # TensorRT-LLM's MoE layer (tensorrt_llm/layers/moe.py `MixtureOfExperts`, `MoeOOTB.load_weights`): `mlp.router`
        # (replicated, never quantized), `mlp.fc` [E, 2I, H] holding each expert's up (HF up_proj, GatedMLP's `gate`)
        # then gate (the activated branch, GatedMLP's `fc`) rows, `mlp.proj` [E, H, I]; biases [E, 2I] and [E, H].
        x = f"{m}.experts"
        return units + [
            Unit(f"{o}.mlp.router", (f"{m}.router",), ("",), "replicated", True, False, None, True),
            Unit(f"{o}.mlp.fc", (f"{x}.up", f"{x}.gate"), ("up", "gate"), "experts", True, quantize, f"{o}.mlp.fc", True, experts),
            Unit(f"{o}.mlp.proj", (f"{x}.down",), ("",), "row", True, quantize, None, True, experts),
        ]
    return units + [
        Unit(f"{o}.mlp.fc", (f"{m}.gate_proj",), ("",), "column", True, quantize, f"{o}.mlp", mb),
        Unit(f"{o}.mlp.gate", (f"{m}.up_proj",), ("",), "column", True, quantize, f"{o}.mlp", mb),
        Unit(f"{o}.mlp.proj", (f"{m}.down_proj",), ("",), "row", True, quantize, None, mb),
    ]


def target_units(cfg: TargetConfig, fmt: str = "trtllm", quantize: bool = False) -> tuple[list[Unit], list[KVUnit]]:
    if fmt == "hf":
        units = [Unit("model.embed_tokens.weight", ("model.embed_tokens.weight",), ("",), "replicated", False)]
        for i in range(cfg.num_layers):
            units += _layer_units(f"model.layers.{i}", "", cfg, fmt, quantize, i)
        units.append(Unit("model.norm.weight", ("model.norm.weight",), ("",), "replicated", False))
        if not cfg.tie_word_embeddings:
            units.append(Unit("lm_head.weight", ("lm_head.weight",), ("",), "replicated", False))
        kv = [KVUnit(f"model.layers.{i}.self_attn", f"layers.{i}", i) for i in range(cfg.num_layers)]
        return units, kv
    units = [Unit("transformer.vocab_embedding.weight", ("model.embed_tokens.weight",), ("",), "vocab", False)]
    for i in range(cfg.num_layers):
        units += _layer_units(f"model.layers.{i}", f"transformer.layers.{i}", cfg, fmt, quantize, i)
    units.append(Unit("transformer.ln_f.weight", ("model.norm.weight",), ("",), "replicated", False))
    # TensorRT-LLM checkpoints always carry lm_head (share_embedding_table: false); a tied model gets a copy.
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    units.append(Unit("lm_head.weight", (head,), ("",), "vocab", False))
    kv = [KVUnit(f"transformer.layers.{i}.attention", f"layers.{i}", i) for i in range(cfg.num_layers)]
    return units, kv


def drafter_units(cfg: DrafterConfig, fmt: str = "trtllm", quantize: bool = False) -> tuple[list[Unit], list[KVUnit]]:
    """The drafter: its layers like the target's; `fc` (context projection) and `hidden_norm` replicated
    on every rank, because the context vector is normed over the full hidden size before every layer's
    K/V projection reads it."""
    units: list[Unit] = []
    for i in range(cfg.num_layers):
        units += _layer_units(f"layers.{i}", f"transformer.layers.{i}", cfg, fmt, quantize, i)
    if fmt == "hf":
        units += [
            Unit("norm.weight", ("norm.weight",), ("",), "replicated", False),
            Unit("fc", ("fc",), ("",), "replicated", True, quantize),
            Unit("hidden_norm.weight", ("hidden_norm.weight",), ("",), "replicated", False),
        ]
        kv_prefix = "layers.{i}.self_attn"
    else:
        units += [
            Unit("transformer.ln_f.weight", ("norm.weight",), ("",), "replicated", False),
            Unit("transformer.fc", ("fc",), ("",), "replicated", True, quantize),
            Unit("transformer.hidden_norm.weight", ("hidden_norm.weight",), ("",), "replicated", False),
        ]
        kv_prefix = "transformer.layers.{i}.attention"
    if cfg.draft_vocab_size is not None:
        units.append(Unit("d2t", ("d2t",), ("",), "replicated", False))
    return units, [KVUnit(kv_prefix.format(i=i), f"layers.{i}", i) for i in range(cfg.num_layers)]


# ----------------------------------------------------------------------------------------------------
# Shapes and row placement per rank


def source_rows_to_rank(unit: Unit, part: str, src_rows: int, cfg: TransformerConfig, tp: int, rank: int) -> list[shard_rules.RowMap]:
    if unit.split == "experts":
        return shard_rules.expert_rows(part, unit.experts, cfg.intermediate_size, tp, rank)
    if unit.split == "qkv":
        return shard_rules.qkv_rows(part, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, tp, rank)
    if unit.split == "column":
        return shard_rules.column_rows(src_rows, tp, rank)
    if unit.split == "vocab":
        return shard_rules.vocab_rows(src_rows, tp, rank)
    return [shard_rules.RowMap(0, 0, src_rows)]


def out_rows(unit: Unit, src_rows: int, cfg: TransformerConfig, tp: int) -> int:
    if unit.split == "qkv":
        return shard_rules.qkv_rows_per_rank(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, tp)
    if unit.split == "experts":
        return 2 * unit.experts * shard_rules.expert_width(cfg.intermediate_size, tp)
    if unit.split == "column":
        return src_rows // tp
    if unit.split == "vocab":
        return shard_rules.pad_vocab_size(src_rows, tp) // tp
    return src_rows


class ScaleNames(NamedTuple):
    """Suffixes of a quantized linear's scale tensors in one format."""

    weight: str  # FP8: the per-tensor weight scale; NVFP4: the per-block FP8 scales
    weight_2: str  # NVFP4's global (second-level) weight scale
    input: str  # the static activation scale


def scale_names(fmt: str) -> ScaleNames:
    if fmt == "hf":
        return ScaleNames("weight_scale", "weight_scale_2", "input_scale")
    return ScaleNames("weights_scaling_factor", "weights_scaling_factor_2", "activation_scaling_factor")


def kv_tensor_names(kv: KVUnit, fmt: str) -> dict[str, str]:
    """Names of one layer's KV-cache scales: {"k": ..., "v": ...} and, for TensorRT-LLM, the merged "kv"."""
    if fmt == "hf":
        return {"k": f"{kv.out}.k_proj.k_scale", "v": f"{kv.out}.v_proj.v_scale"}
    return {"kv": f"{kv.out}.kv_cache_scaling_factor", "k": f"{kv.out}.k_cache_scaling_factor", "v": f"{kv.out}.v_cache_scaling_factor"}


# ----------------------------------------------------------------------------------------------------
# config.json


def _common_config(cfg: TransformerConfig, dtype: torch.dtype, tp: int, quant: str, kv_quant: str, architecture: str, decoder: str) -> dict[str, Any]:
    """The keys ModelOpt's export writes (same names, same values), then the ones it leaves out but
    TensorRT-LLM reads (rotary_base, rotary_scaling, qk_layernorm, qwen_type)."""
    rope = cfg.rope
    quantization: dict[str, Any] = {"quant_algo": QUANT_ALGOS[quant], "kv_cache_quant_algo": QUANT_ALGOS[kv_quant]}
    if quant == "nvfp4":
        quantization["group_size"] = NVFP4_BLOCK
    if quant != "none":
        quantization["exclude_modules"] = list(EXCLUDED_MODULES)
    raw: dict[str, Any] = {
        "producer": producer(),
        "architecture": architecture,
        "dtype": STR_DTYPES[dtype],
        # fp32 logits: verification compares argmaxes, and fp16 logits would turn near-ties into flips
        "logits_dtype": "float32",
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "hidden_size": cfg.hidden_size,
        "norm_epsilon": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "use_parallel_embedding": True,
        "embedding_sharding_dim": 0,
        "head_size": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "position_embedding_type": "rope_gpt_neox",
        "share_embedding_table": False,
        "residual_mlp": False,
        "bias": cfg.attention_bias,
        "rotary_pct": 1.0,
        "rank": 0,
        "decoder": decoder,
        "rmsnorm": True,
        "lm_head_bias": False,
        "mapping": {"world_size": tp, "tp_size": tp, "pp_size": 1},
        "quantization": quantization,
        "rotary_base": rope.theta,
        "rotary_scaling": None if rope.type == "default" else {"type": rope.type, "factor": rope.factor} | _rope_extras(rope),
        "qk_layernorm": cfg.qk_norm,
        "attn_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
    }
    return raw


def _rope_extras(rope) -> dict[str, Any]:
    """The scaled RoPE's own parameters, under Hugging Face's names (what trtllm_config reads back)."""
    if rope.type == "llama3":
        return {"low_freq_factor": rope.low_freq_factor, "high_freq_factor": rope.high_freq_factor,
                "original_max_position_embeddings": rope.original_max_position_embeddings}
    if rope.type == "yarn":
        return {"original_max_position_embeddings": rope.original_max_position_embeddings, "beta_fast": rope.beta_fast,
                "beta_slow": rope.beta_slow, "truncate": rope.truncate, "attention_factor": rope.attention_factor}
    return {}


def producer() -> dict[str, str]:
    """The `producer` both checkpoint formats' configs carry (ModelOpt writes its own name and version there)."""
    from . import __version__

    return {"name": "dflash-trt", "version": __version__}


def target_config_json(cfg: TargetConfig, dtype: torch.dtype, tp: int, quant: str, kv_quant: str) -> dict[str, Any]:
    family = TARGET_ARCHITECTURES[cfg.architecture]
    arch, decoder = TRTLLM_TARGET_ARCHITECTURES[family]
    raw = _common_config(cfg, dtype, tp, quant, kv_quant, arch, decoder)
    if family == "qwen3":
        raw["qwen_type"] = "qwen3"
    if family == "gpt_oss":
        # `moe` as TensorRT-LLM's PretrainedConfig nests MoeConfig (num_experts, top_k); the routing is top-k over the
        # router logits, then a softmax over the chosen ones. The rest is gpt-oss's own, under Hugging Face's names.
        raw |= {"moe": {"num_experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok}, "attention_sinks": True,
                "layer_types": list(cfg.layer_types), "sliding_window": cfg.sliding_window,
                "swiglu_alpha": cfg.swiglu_alpha, "swiglu_limit": cfg.swiglu_limit}
    raw["tie_word_embeddings"] = cfg.tie_word_embeddings
    raw["bos_token_id"] = cfg.bos_token_id
    raw["eos_token_id"] = list(cfg.eos_token_ids)
    return raw


def drafter_config_json(cfg: DrafterConfig, target: TargetConfig, dtype: torch.dtype, tp: int, quant: str, kv_quant: str) -> dict[str, Any]:
    raw = _common_config(cfg, dtype, tp, quant, kv_quant, TRTLLM_DRAFTER_ARCHITECTURE, "dflash")
    raw.update(
        block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id,
        target_layer_ids=list(cfg.target_layer_ids),
        num_target_layers=target.num_layers,
        target_hidden_size=target.hidden_size,
        layer_types=list(cfg.layer_types),
        sliding_window=cfg.sliding_window,
        causal=cfg.causal_override,
        draft_vocab_size=cfg.draft_vocab_size,
    )
    return raw


def read_trtllm_config(directory: str | Path) -> tuple[Path, dict[str, Any]]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError("config.json is missing", file=path)
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"not valid JSON ({e})", file=path) from None
    if not isinstance(raw, dict) or "mapping" not in raw or "architecture" not in raw:
        raise ConfigError("not a TensorRT-LLM checkpoint config (no 'architecture' / 'mapping')", file=path)
    return path, raw


def _trtllm_config_or_none(directory: str | Path) -> dict[str, Any] | None:
    """The directory's config.json when it is a TensorRT-LLM checkpoint's, else None (no error: a probe)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return raw if isinstance(raw, dict) and "mapping" in raw and "architecture" in raw else None


def is_trtllm_checkpoint(directory: str | Path) -> bool:
    return _trtllm_config_or_none(directory) is not None


def parse_trtllm_target_config(raw: dict[str, Any], path: Path) -> TargetConfig:
    return parse_target_config(trtllm_target_as_hf(raw, path, {v: k for k, v in TARGET_ARCHITECTURES.items()}), path)


def parse_trtllm_drafter_config(raw: dict[str, Any], path: Path) -> DrafterConfig:
    return parse_drafter_config(trtllm_drafter_as_hf(raw, path, DRAFTER_ARCHITECTURE), path)


# ----------------------------------------------------------------------------------------------------
# Reading a rank back (dequantized, Hugging Face names)


def _tp_of(raw: dict[str, Any], path: Path) -> int:
    mapping = raw.get("mapping")
    if not isinstance(mapping, dict) or not isinstance(mapping.get("tp_size", 1), int):
        raise ConfigError("expected an object with an integer tp_size", file=path, key="mapping")
    if mapping.get("pp_size", 1) != 1:
        raise ConfigError("pipeline parallelism is not supported", file=path, key="mapping.pp_size")
    return int(mapping.get("tp_size", 1))


def read_rank(directory: str | Path, rank: int = 0, dtype: torch.dtype = torch.float32, part: str = "target") -> tuple[TargetConfig | DrafterConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, tensors, raw config.json) of rank `rank` of a converted target or drafter: HF-named
    tensors holding that rank's shard (q/k/v split back out of the fused qkv, weights dequantized to
    `dtype`, vocab rows padded to a multiple of tp). Quantization scales are returned under
    `<module>.input_scale` / `.k_scale` / `.v_scale` (fp32), for fake-quant or the engine path.
    `part` ("target" / "drafter") picks the model out of a one-engine checkpoint; a checkpoint of one
    model is read whole (its architecture says which it is)."""
    directory = Path(directory)
    path, raw = read_trtllm_config(directory)
    tp = _tp_of(raw, path)
    if not 0 <= rank < tp:
        raise ConfigError(f"rank {rank} is outside mapping.tp_size={tp}", file=path, key="mapping.tp_size")
    prefix = ""
    engine = raw.get("architecture") == ENGINE_ARCHITECTURE
    if engine:
        prefix = ENGINE_DRAFTER_PREFIX if part == "drafter" else ""
        raw = engine_part_config(raw, path, part)
    is_drafter = raw.get("architecture") == TRTLLM_DRAFTER_ARCHITECTURE
    cfg = parse_trtllm_drafter_config(raw, path) if is_drafter else parse_trtllm_target_config(raw, path)
    quant = {v: k for k, v in QUANT_ALGOS.items()}.get(raw.get("quantization", {}).get("quant_algo"))
    if quant is None:
        raise ConfigError(f"unsupported quant_algo {raw['quantization'].get('quant_algo')!r}", file=path, key="quantization.quant_algo")
    units, kv_units = drafter_units(cfg, quantize=quant != "none") if is_drafter else target_units(cfg, quantize=quant != "none")
    shard = directory / f"rank{rank}.safetensors"
    if not shard.is_file():
        raise CheckpointError(f"missing shard for rank {rank} of tp_size={tp}", file=shard)
    ckpt = SafetensorsCheckpoint(directory, files=[shard.name])
    used: set[str] = set()
    names = scale_names("trtllm")

    def get(name: str) -> torch.Tensor:
        name = prefix + name
        if name not in ckpt:
            raise CheckpointError("required tensor is missing", file=shard, key=name)
        used.add(name)
        return ckpt.get(name)

    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[str, torch.Tensor]] = {}  # an MoE layer's fc / proj (and biases), until both are read

    def rows(t: torch.Tensor, unit: Unit) -> torch.Tensor:
        return t.reshape(-1, t.shape[-1]) if unit.experts else t  # an expert stack [E, R, C] as the rows it was written as

    for unit in units:
        if not unit.linear:
            t = get(unit.out)
            out[unit.sources[0]] = t.to(dtype) if t.is_floating_point() else t
            continue
        w = rows(get(unit.out + ".weight"), unit)
        if unit.quantized and quant == "fp8" and unit.experts:  # one scale per expert, (E, 1)
            w = dequantize_fp8(w.view(unit.experts, -1, w.shape[-1]), get(f"{unit.out}.{names.weight}").view(-1, 1, 1), dtype).flatten(0, 1)
        elif unit.quantized and quant == "fp8":
            w = dequantize_fp8(w, get(f"{unit.out}.{names.weight}"), dtype)
        elif unit.quantized and quant == "nvfp4":
            w = dequantize_nvfp4(w, rows(get(f"{unit.out}.{names.weight}"), unit), get(f"{unit.out}.{names.weight_2}"), dtype)
        else:
            w = w.to(dtype)
        bias = get(unit.out + ".bias").to(dtype).reshape(-1) if unit.bias else None
        act = get(f"{unit.out}.{names.input}").float() if unit.quantized else None
        if unit.experts:
            module = unit.sources[0].rsplit(".", 1)[0]  # {mlp}.experts
            stack = stacks.setdefault(module, {})
            stack |= {"fc": w, "fc_bias": bias} if unit.split == "experts" else {"proj": w, "proj_bias": bias}
            if act is not None:
                out[f"{module}.{'gate_up_proj' if unit.split == 'experts' else 'down_proj'}.input_scale"] = act
            if len(stack) == 4:
                real = cfg.intermediate_size // tp
                out |= {f"{module}.{k}": v for k, v in experts_as_module(**stacks.pop(module), experts=unit.experts, real=real).items()}
            continue
        if unit.split == "qkv":
            q_rows = cfg.num_heads // tp * cfg.head_dim
            kv_rows = shard_rules.kv_heads_per_rank(cfg.num_kv_heads, tp) * cfg.head_dim
            pieces = zip(unit.sources, (0, q_rows, q_rows + kv_rows), (q_rows, kv_rows, kv_rows))
        else:
            pieces = [(unit.sources[0], 0, w.shape[0])]
        for src, start, n in pieces:
            out[src + ".weight"] = w[start : start + n].contiguous()
            if bias is not None:
                out[src + ".bias"] = bias[start : start + n].contiguous()
            if act is not None:
                out[src + ".input_scale"] = act
    if raw.get("quantization", {}).get("kv_cache_quant_algo") == QUANT_ALGOS["fp8"]:
        for kv in kv_units:
            names_kv = kv_tensor_names(kv, "trtllm")
            attn = f"{'layers' if is_drafter else 'model.layers'}.{kv.layer}.self_attn"
            out[f"{attn}.k_proj.k_scale"] = get(names_kv["k"]).float()
            out[f"{attn}.v_proj.v_scale"] = get(names_kv["v"]).float()
            get(names_kv["kv"])
    # In a one-engine rank file the other model's tensors are not extra: they are the other part's.
    mine = [k for k in ckpt.keys() if k.startswith(ENGINE_DRAFTER_PREFIX) == bool(prefix)] if engine else ckpt.keys()
    extra = sorted(set(mine) - used)
    if extra:
        raise CheckpointError("unexpected tensor (not part of this architecture and quantization)", file=shard, key=extra[0])
    return cfg, out, raw


SCALE_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")


def trtllm_source(directory: str | Path, rank: int, dtype: torch.dtype, part: str = "target") -> tuple[TargetConfig | DrafterConfig, InMemorySource]:
    """A rank of a converted checkpoint as a TensorSource for `load_module` (scales left out)."""
    cfg, tensors, _ = read_rank(directory, rank, dtype, part)
    shard = Path(directory) / f"rank{rank}.safetensors"
    weights = {k: v for k, v in tensors.items() if not k.endswith(SCALE_SUFFIXES)}
    return cfg, InMemorySource(weights, dict.fromkeys(weights, shard), Path(directory))


def single_rank_source(directory: str | Path, dtype: torch.dtype, part: str = "target") -> tuple[TargetConfig | DrafterConfig, InMemorySource]:
    """The whole model of a tp=1 checkpoint (a single process cannot run a sharded one)."""
    path, raw = read_trtllm_config(directory)
    tp = _tp_of(raw, path)
    if tp != 1:
        raise ConfigError(f"this checkpoint is sharded for tp_size={tp}: run it with `mpirun -n {tp}` (the TP runtime)", file=path, key="mapping.tp_size")
    return trtllm_source(directory, 0, dtype, part)


# ----------------------------------------------------------------------------------------------------
# The one-engine checkpoint: DFlashForCausalLM (target + drafter), what trtllm-build reads for the
# engine on EAGLE's contract (docs/engine-path.md, "One engine call")


def is_engine_checkpoint(directory: str | Path) -> bool:
    raw = _trtllm_config_or_none(directory)
    return raw is not None and raw.get("architecture") == ENGINE_ARCHITECTURE


def engine_config_json(target: dict[str, Any], drafter: dict[str, Any], target_path: Path, drafter_path: Path) -> dict[str, Any]:
    """config.json of the one engine from the two converted configs; refuses what one engine cannot hold."""
    if target.get("architecture") == ENGINE_ARCHITECTURE or drafter.get("architecture") != TRTLLM_DRAFTER_ARCHITECTURE:
        raise ConfigError(f"expected a converted target and a {TRTLLM_DRAFTER_ARCHITECTURE} drafter", file=drafter_path, key="architecture")
    # One paged pool holds the target's layers and the drafter's (EagleForCausalLM's layer_idx_offset): one
    # KV head count, head size, KV dtype and mapping for all of them.
    for key in ("num_key_value_heads", "head_size", "mapping", "dtype"):
        if drafter.get(key) != target.get(key):
            raise ConfigError(
                f"{drafter.get(key)!r} != the target's {target.get(key)!r} ({target_path}): the engine's one KV pool and one "
                "mapping hold both models", file=drafter_path, key=key,
            )
    kv_algo = lambda raw: (raw.get("quantization") or {}).get("kv_cache_quant_algo")  # noqa: E731
    if kv_algo(drafter) != kv_algo(target):
        raise ConfigError(f"{kv_algo(drafter)!r} != the target's {kv_algo(target)!r}: one KV pool, one KV dtype", file=drafter_path,
                          key="quantization.kv_cache_quant_algo")
    block = drafter.get("block_size")
    if not isinstance(block, int) or block < 2:
        raise ConfigError(f"expected an integer >= 2, got {block!r}", file=drafter_path, key="block_size")
    k = block - 1  # the block [last accepted, mask x K] proposes K drafts: a one-path tree of depth K
    return {
        **target,
        "architecture": ENGINE_ARCHITECTURE,
        "base_architecture": target["architecture"],
        "max_draft_len": k,
        "num_eagle_layers": k,
        "max_non_leaves_per_layer": 1,
        "eagle_net_config": drafter,
    }


def merge_engine_checkpoint(parts: Path, dest: Path) -> list[str]:
    """Write the one-engine checkpoint into `dest` from a converter output `parts` (target/, drafter/):
    config.json (engine_config_json) and rank{r}.safetensors = the target's tensors under their names +
    the drafter's under ENGINE_DRAFTER_PREFIX, copied byte for byte (quantized tensors and scales as
    they are), row chunks at a time. Returns the rank files written."""
    t_path, t_raw = read_trtllm_config(parts / "target")
    d_path, d_raw = read_trtllm_config(parts / "drafter")
    raw = engine_config_json(t_raw, d_raw, t_path, d_path)
    files = []
    for rank in range(_tp_of(t_raw, t_path)):
        name = f"rank{rank}.safetensors"
        sources = [(SafetensorsFile(parts / "target" / name), ""), (SafetensorsFile(parts / "drafter" / name), ENGINE_DRAFTER_PREFIX)]
        try:
            declared = {}
            for src, prefix in sources:
                for key, info in src.tensors.items():
                    if key.startswith(ENGINE_DRAFTER_PREFIX) and not prefix:
                        raise CheckpointError(f"a target tensor name may not start with {ENGINE_DRAFTER_PREFIX!r}", file=src.path, key=key)
                    declared[prefix + key] = (info.dtype, info.shape)
            writer = SafetensorsWriter(dest / name, declared)
            try:
                for src, prefix in sources:
                    for key in src.tensors:
                        for lo, rows in src.row_chunks(key):
                            writer.write_rows(prefix + key, lo, rows)
                writer.finish()
            finally:
                writer.close()
        finally:
            for src, _ in sources:
                src.close()
        files.append(name)
    (dest / "config.json").write_text(json.dumps(raw, indent=4) + "\n")
    return files


def quantized_hf_config_json(source: dict[str, Any], is_target: bool, dtype: torch.dtype, quant: str, kv_quant: str,
                             routers: list[str] = ()) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """ModelOpt's unified quantized-HF configs for one model: the source config.json plus `quantization_config`, and
    hf_quant_config.json (None when nothing is quantized), with the keys and values ModelOpt 0.47's
    export_hf_checkpoint writes (tests/test_convert_modelopt.py). `routers`: an MoE target's router modules, which
    ModelOpt lists as excluded (they are not nn.Linear, so never quantized). A source's own `quantization_config`
    (a released gpt-oss's MXFP4) is dropped: the tensors written are not in that format."""
    raw = {k: v for k, v in source.items() if k != "quantization_config"}
    raw["torch_dtype"] = STR_DTYPES[dtype]
    if quant == "none" and kv_quant == "none":
        return raw, None
    entry = producer()
    exclude = list(EXCLUDED_MODULES) + (["model.embed_tokens"] if is_target else []) + list(routers)
    hf_quant: dict[str, Any] = {"quant_algo": QUANT_ALGOS[quant], "kv_cache_quant_algo": QUANT_ALGOS[kv_quant]}
    if quant == "nvfp4":
        hf_quant["group_size"] = NVFP4_BLOCK
    hf_quant["exclude_modules"] = exclude
    qc: dict[str, Any] = {"quant_method": "modelopt", "quant_algo": hf_quant["quant_algo"], "ignore": exclude, "producer": entry}
    if quant != "none":
        bits = {"num_bits": 8, "type": "float"} if quant == "fp8" else {"num_bits": 4, "type": "float", "group_size": NVFP4_BLOCK}
        qc["config_groups"] = {"group_0": {"input_activations": {"dynamic": False, **bits}, "weights": {"dynamic": False, **bits}, "targets": ["Linear"]}}
    if kv_quant == "fp8":
        qc["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    raw["quantization_config"] = qc
    return raw, {"producer": entry, "quantization": hf_quant}


# ----------------------------------------------------------------------------------------------------
# ModelOpt's quantized-HF format back (what `convert --format hf` writes)


def dequantize_expert_stack(q: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """An expert stack of ModelOpt's HF export back to [E, in, out]: FP8 (`scale` one scalar for the stack), or NVFP4
    (`q` [E, in/2, out] uint8 with the nibbles paired along the inputs, `scale` the block scales [E, in/16, out],
    `scale_2` the stack's global scale): the output-major layout the NVFP4 formulas read is the transpose."""
    if scale_2 is None:
        return dequantize_fp8(q, scale, dtype)
    return dequantize_nvfp4(q.transpose(-1, -2), scale.transpose(-1, -2), scale_2, dtype).transpose(-1, -2).contiguous()


def is_quantized_hf(directory: str | Path) -> bool:
    return (Path(directory) / "hf_quant_config.json").is_file()


def quantized_hf_source(directory: str | Path, dtype: torch.dtype) -> InMemorySource:
    """HF-named weights of a ModelOpt-format quantized checkpoint, dequantized (scales left out)."""
    directory = Path(directory)
    qpath = directory / "hf_quant_config.json"
    try:
        algo = json.loads(qpath.read_text())["quantization"]["quant_algo"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ConfigError("malformed (expected {'quantization': {'quant_algo': ...}})", file=qpath, key="quantization.quant_algo") from None
    if algo not in QUANT_ALGOS.values():
        raise ConfigError(f"unsupported quant_algo {algo!r}; expected one of {[a for a in QUANT_ALGOS.values() if a]}", file=qpath,
                          key="quantization.quant_algo")
    ckpt = SafetensorsCheckpoint(directory)
    names = scale_names("hf")
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for name in ckpt.keys():
        if name.endswith(tuple("." + s for s in names) + tuple("_" + s for s in names) + (".k_scale", ".v_scale")):
            continue
        t = ckpt.get(name)
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if f"{name}_{names.weight}" in ckpt:  # a fused expert stack (gpt-oss's gate_up_proj / down_proj), [E, in, out]
            t = dequantize_expert_stack(t, ckpt.get(f"{name}_{names.weight}"), ckpt.get(f"{name}_{names.weight_2}")
                                        if algo == QUANT_ALGOS["nvfp4"] else None, dtype)
        elif module is not None and f"{module}.{names.weight}" in ckpt:
            scale = ckpt.get(f"{module}.{names.weight}")
            if algo == QUANT_ALGOS["nvfp4"]:
                t = dequantize_nvfp4(t, scale, ckpt.get(f"{module}.{names.weight_2}"), dtype)
            else:
                t = dequantize_fp8(t, scale, dtype)
        elif t.is_floating_point():
            t = t.to(dtype)
        tensors[name] = t
        origin[name] = ckpt.file_of(name)
    return InMemorySource(tensors, origin, directory)


# ----------------------------------------------------------------------------------------------------
# gpt-oss releases: MXFP4 experts (quant/mxfp4.py)

MXFP4_PACKED = ("_blocks", "_scales")


def is_mxfp4_checkpoint(directory: str | Path) -> bool:
    """A Hugging Face directory whose config says `quantization_config.quant_method: mxfp4` (openai/gpt-oss-*)."""
    path = Path(directory) / "config.json"
    try:
        quant = json.loads(path.read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


class Mxfp4Source(SafetensorsCheckpoint):
    """A released gpt-oss checkpoint with the module's names: each `X_blocks` + `X_scales` pair reads as `X`,
    dequantized on `get` and transposed to the transformers layout ([E, rows, cols] stored → [E, cols, rows]); every
    other tensor as stored. A pair missing its half, or blocks and scales that disagree, is a CheckpointError."""

    def __init__(self, directory: str | Path):
        super().__init__(directory)
        self.stored = stored = dict(self.weight_map)
        self.packed: dict[str, tuple[str, str]] = {}
        names: dict[str, Path] = {}
        for name, file in stored.items():
            if name.endswith("_scales") and name[: -len("_scales")] + "_blocks" not in stored:
                raise CheckpointError("MXFP4 scales without their _blocks", file=file, key=name)
            if not name.endswith(MXFP4_PACKED):
                names[name] = file
                continue
            if name.endswith("_scales"):
                continue
            base = name[: -len("_blocks")]
            if base + "_scales" not in stored:
                raise CheckpointError("MXFP4 blocks without their _scales", file=file, key=name)
            blocks, scales = self._stored_shape(name), self._stored_shape(base + "_scales")
            if len(blocks) != 4 or blocks[:-1] != scales or blocks[-1] != MXFP4_BLOCK // 2:
                raise CheckpointError(f"MXFP4 blocks {list(blocks)} do not match scales {list(scales)} (expected [E, rows, G, "
                                      f"{MXFP4_BLOCK // 2}] and [E, rows, G])", file=file, key=name)
            self.packed[base] = (name, base + "_scales")
            names[base] = file
        self.weight_map = names

    def _stored_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.stored[name]).tensors[name].shape)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.packed:
            experts, rows, groups, _ = self._stored_shape(self.packed[name][0])
            return (experts, groups * MXFP4_BLOCK, rows)
        return super().shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return torch.float32 if name in self.packed else super().dtype(name)

    def _dequantized(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Experts [start, stop) of a packed pair, as stored: [n, rows, cols] (row r = output r)."""
        blocks_name, scales_name = self.packed[name]
        try:
            return dequantize_mxfp4(*(self._open(self.stored[n]).read_rows(n, start or 0, stop) for n in (blocks_name, scales_name)))
        except ValueError as e:
            raise CheckpointError(str(e), file=self.file_of(name), key=blocks_name) from None

    def get(self, name: str) -> torch.Tensor:
        if name not in self.packed:
            return super().get(name)
        return self._dequantized(name).transpose(1, 2).contiguous()

    def row_chunks(self, name: str, bytes_per_row: int | None = None):
        """A packed tensor one expert at a time (dequantized, in the module's layout); others as stored."""
        if name not in self.packed:
            yield from super().row_chunks(name, bytes_per_row)
            return
        for e in range(self.shape(name)[0]):
            yield e, self._dequantized(name, e, e + 1).transpose(1, 2).contiguous()

    def nbytes(self, name: str) -> int:
        if name not in self.packed:
            return super().nbytes(name)
        return sum(self._open(self.stored[n]).tensors[n].end - self._open(self.stored[n]).tensors[n].start for n in self.packed[name])

    def expert_matrix(self, name: str, e: int) -> torch.Tensor:
        if name not in self.packed:
            return super().expert_matrix(name, e)
        return self._dequantized(name, e, e + 1)[0]  # stored output-major already


class ExpertView:
    """What the TensorRT-LLM converter reads from a gpt-oss checkpoint: its tensors as they are, plus, per MoE layer,
    the experts as virtual 2-D output-major tensors (`{mlp}.experts.gate` / `.up` [E·I, H], `.down` [E·H, I], each with
    `.weight` and `.bias`), so that the row-wise writer (shard maps, FP8 / NVFP4 row encoding) handles them like
    any linear. The module's `gate_up_proj` [E, H, 2I] is input-major with gate and up interleaved (gate = even
    columns); `down_proj` [E, I, H] is input-major. Rows are produced one expert at a time (`row_chunks`)."""

    def __init__(self, base: SafetensorsCheckpoint, num_layers: int):
        self.base = base
        self.virtual: dict[str, tuple[str, str, str]] = {}  # name → (stored tensor, part, weight | bias)
        for i in range(num_layers):
            x = f"model.layers.{i}.mlp.experts"
            for part in EXPERT_PARTS:
                stored = f"{x}.down_proj" if part == "down" else f"{x}.gate_up_proj"
                self.virtual[f"{x}.{part}.weight"] = (stored, part, "weight")
                self.virtual[f"{x}.{part}.bias"] = (stored + "_bias", part, "bias")

    def __contains__(self, name: str) -> bool:
        return name in self.virtual or name in self.base

    def keys(self) -> list[str]:
        return self.base.keys()

    def file_of(self, name: str) -> Path:
        return self.base.file_of(self.virtual[name][0] if name in self.virtual else name)

    def nbytes(self, name: str) -> int:
        return self.base.nbytes(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.base.dtype(self.virtual[name][0] if name in self.virtual else name)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.virtual:
            return self.base.shape(name)
        stored, part, kind = self.virtual[name]
        if kind == "bias":
            experts, width = self.base.shape(stored)
            return (experts * (width // 2 if part != "down" else width),)
        experts, inputs, outputs = self.base.shape(stored)
        return (experts * (outputs // 2 if part != "down" else outputs), inputs)

    @staticmethod
    def _pick(rows: torch.Tensor, part: str) -> torch.Tensor:
        """The part's rows out of an output-major expert (interleaved gate/up; down whole)."""
        return rows[0::2] if part == "gate" else rows[1::2] if part == "up" else rows

    def row_chunks(self, name: str, bytes_per_row: int | None = None):
        if name not in self.virtual:
            yield from self.base.row_chunks(name, bytes_per_row)
            return
        stored, part, kind = self.virtual[name]
        if kind == "bias":
            yield 0, self.get(name)
            return
        per = self.shape(name)[0] // self.base.shape(stored)[0]
        for e in range(self.base.shape(stored)[0]):
            yield e * per, self._pick(self.base.expert_matrix(stored, e), part).contiguous()

    def get(self, name: str) -> torch.Tensor:
        if name not in self.virtual:
            return self.base.get(name)
        stored, part, kind = self.virtual[name]
        if kind == "bias":
            bias = self.base.get(stored)  # [E, 2I] interleaved, or [E, H]
            return self._pick(bias.transpose(0, 1), part).transpose(0, 1).reshape(-1).contiguous()
        return torch.cat([rows for _, rows in self.row_chunks(name)])


def experts_as_module(fc: torch.Tensor, fc_bias: torch.Tensor, proj: torch.Tensor, proj_bias: torch.Tensor, experts: int,
                      real: int) -> dict[str, torch.Tensor]:
    """A rank's TensorRT-LLM MoE tensors (fc [E·2W, H] with up then gate rows per expert, proj [E·H, W], biases [E·2W]
    and [E·H], 2-D as read back; the first `real` of the W = expert_width columns real, the rest zero padding) in the
    module's layout and names (models/moe.py `Experts`), padding dropped."""
    width = fc.shape[0] // experts // 2
    fc, fc_bias = fc.reshape(experts, 2, width, -1)[:, :, :real], fc_bias.reshape(experts, 2, width)[:, :, :real]
    gate_up = torch.stack([fc[:, 1], fc[:, 0]], dim=2).reshape(experts, 2 * real, -1)  # rows gate, up, gate, up ...
    gate_up_bias = torch.stack([fc_bias[:, 1], fc_bias[:, 0]], dim=2).reshape(experts, 2 * real)
    hidden = proj.shape[0] // experts
    return {
        "gate_up_proj": gate_up.transpose(1, 2).contiguous(),
        "gate_up_proj_bias": gate_up_bias.contiguous(),
        "down_proj": proj.reshape(experts, hidden, -1)[:, :, :real].transpose(1, 2).contiguous(),
        "down_proj_bias": proj_bias.reshape(experts, hidden),
    }

"""`dflash-trt convert`: a Hugging Face target + DFlash drafter → TensorRT-LLM checkpoints (BF16 / FP16 /
FP32, FP8, NVFP4; sharded for tp ranks) or ModelOpt's quantized-HF format.

Streaming: every output tensor is produced from row chunks of its source tensors, read with
positional reads and written in place into each rank's file (safetensors_io.py), so memory stays at
a few chunks whatever the model size. Output goes to a temporary directory beside `--out` and is
renamed at the end; an error or Ctrl-C leaves nothing behind.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from .progress import progress_bar

from . import shard_rules
from .checkpoint import SafetensorsCheckpoint, atomic_directory, check_finite
from .config import (
    DrafterConfig,
    TargetConfig,
    TransformerConfig,
    check_pair,
    load_drafter_config,
    load_target_config,
)
from .errors import CheckpointError, ConfigError
from .loading import (
    DTYPES, SPECULATORS_ONLY_TENSORS, check_d2t_ids, encode_prompt, is_speculators_drafter, load_tokenizer, load_torch_backend,
    read_prompts, speculators_source,
)
from .quant import fp8_scale, kv_cache_scale, nvfp4_activation_scale, nvfp4_global_scale, quantize_fp8, quantize_nvfp4
from .quant.nvfp4 import BLOCK
from .safetensors_io import SafetensorsWriter
from .checkpoint_formats import (
    ExpertView,
    KVUnit,
    Mxfp4Source,
    is_mxfp4_checkpoint,
    Unit,
    drafter_config_json,
    drafter_units,
    kv_tensor_names,
    merge_engine_checkpoint,
    quantized_hf_config_json,
    out_rows,
    scale_names,
    source_rows_to_rank,
    target_config_json,
    target_units,
)


FORMATS = {
    "trtllm": "TensorRT-LLM checkpoints OUT/target and OUT/drafter (config.json + rank{r}.safetensors each)",
    "engine": "one TensorRT-LLM checkpoint of both, DFlashForCausalLM, what `trtllm-build` reads for the one engine (docs/engine-path.md)",
    "hf": "HF names + hf_quant_config.json (ModelOpt's unified format: vLLM, TensorRT-LLM's PyTorch backend)",
    "speculators": "the drafter alone in vLLM's speculators format (config.json + model.safetensors; `vllm serve` loads it)",
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)


@dataclass
class ConvertStats:
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    largest_tensor_bytes: int = 0
    files: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------------
# Quantization schemes: what one linear weight becomes. The writer below streams rows and shards them; it asks the
# scheme for the tensors a weight turns into, its scales, and the encoding of each row chunk, and knows nothing else.


class Plain:
    """No quantization: the weight in the output dtype."""

    name = "none"
    column_divisor = 1  # source columns per stored column (row-parallel weights are sliced by stored columns)
    block_columns = None  # a second per-row tensor (NVFP4's block scales): source columns per entry, or None

    def __init__(self, fmt: str, dtype: torch.dtype):
        self.fmt, self.dtype, self.sn = fmt, dtype, scale_names(fmt)

    def tensors(self, out: str, rows: int, rest: tuple[int, ...], src_dtype: torch.dtype) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {out + ".weight": (self.dtype if src_dtype.is_floating_point else src_dtype, (rows, *rest))}

    def scales(self, weight_amax: float, input_amax: float) -> dict[str, torch.Tensor]:
        """The scale tensors (name suffix → value) of one weight; they also set what `encode` uses for its rows."""
        return {}

    def encode(self, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(stored rows, block-scale rows or None) for a chunk of source rows."""
        return (chunk.to(self.dtype) if chunk.is_floating_point() else chunk), None

    def block_scale_name(self, out: str) -> str:
        """Where `encode`'s block-scale rows go (schemes with block_columns)."""
        return f"{out}.{self.sn.weight}"

    def shares_weight_amax(self) -> bool:
        """One weight amax for a fusion group (q/k/v, gate/up): TensorRT-LLM's fused linears hold one scale;
        ModelOpt's HF export keeps FP8's per linear (weight_scale) but shares NVFP4's global one (weight_scale_2)."""
        return self.fmt == "trtllm"


class Fp8(Plain):
    """FP8 E4M3 weights with one per-tensor weight scale and one static input scale (ModelOpt's FP8)."""

    name = "fp8"

    def tensors(self, out, rows, rest, src_dtype):
        scalar = (1,) if self.fmt == "trtllm" else ()
        return {out + ".weight": (torch.float8_e4m3fn, (rows, *rest)), f"{out}.{self.sn.weight}": (torch.float32, scalar),
                f"{out}.{self.sn.input}": (torch.float32, scalar)}

    def scales(self, weight_amax, input_amax):
        self.weight_scale = fp8_scale(weight_amax)
        values = {self.sn.weight: self.weight_scale, self.sn.input: fp8_scale(input_amax)}
        return {k: v.reshape(()) for k, v in values.items()} if self.fmt == "hf" else values

    def encode(self, chunk):
        return quantize_fp8(chunk, self.weight_scale, round_via=self.dtype if self.fmt == "hf" else None), None


class Nvfp4(Plain):
    """NVFP4: E2M1 values packed two per byte, an FP8 scale per BLOCK columns, one global scale, a static input scale."""

    name = "nvfp4"
    column_divisor = 2
    block_columns = BLOCK

    def tensors(self, out, rows, rest, src_dtype):
        return {out + ".weight": (torch.uint8, (rows, rest[0] // 2)), f"{out}.{self.sn.weight}": (torch.float8_e4m3fn, (rows, rest[0] // BLOCK)),
                f"{out}.{self.sn.weight_2}": (torch.float32, ()), f"{out}.{self.sn.input}": (torch.float32, ())}

    def scales(self, weight_amax, input_amax):
        self.global_scale = nvfp4_global_scale(weight_amax)
        return {self.sn.weight_2: self.global_scale, self.sn.input: nvfp4_activation_scale(input_amax)}

    def encode(self, chunk):
        return quantize_nvfp4(chunk, self.global_scale)

    def shares_weight_amax(self):
        return True


SCHEMES = {"none": Plain, "fp8": Fp8, "nvfp4": Nvfp4}


class Fp8KVCache:
    """FP8 KV cache: each attention layer's K and V scales from calibration (TensorRT-LLM also reads one merged
    scale, the larger of the two)."""

    def __init__(self, fmt: str):
        self.fmt = fmt

    def tensors(self, kv: KVUnit) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        shape = (1,) if self.fmt == "trtllm" else ()
        return {n: (torch.float32, shape) for n in kv_tensor_names(kv, self.fmt).values()}

    def scales(self, kv: KVUnit, k_amax: float, v_amax: float) -> dict[str, torch.Tensor]:
        names = kv_tensor_names(kv, self.fmt)
        if self.fmt == "hf":  # vLLM / SGLang read k_scale / v_scale unclamped
            return {names["k"]: fp8_scale(k_amax).reshape(()), names["v"]: fp8_scale(v_amax).reshape(())}
        k, v = kv_cache_scale(k_amax), kv_cache_scale(v_amax)
        return {names["kv"]: torch.maximum(k, v), names["k"]: k, names["v"]: v}


KV_SCHEMES = {"none": None, "fp8": Fp8KVCache}


# ----------------------------------------------------------------------------------------------------
# One model (target or drafter) → one output directory


class _ModelWriter:
    def __init__(self, name: str, cfg: TransformerConfig, ckpt: SafetensorsCheckpoint, units: list[Unit], kv_units: list[KVUnit],
                 fmt: str, dtype: torch.dtype, quant: str, kv_quant: str, tp: int, amax: dict[str, float], stats: ConvertStats):
        self.name, self.cfg, self.ckpt, self.units, self.kv_units = name, cfg, ckpt, units, kv_units
        self.fmt, self.dtype, self.quant, self.kv_quant, self.tp, self.amax, self.stats = fmt, dtype, quant, kv_quant, tp, amax, stats
        self.sn = scale_names(fmt)
        self.plain = Plain(fmt, dtype)
        self.scheme = self.plain if quant == "none" else SCHEMES[quant](fmt, dtype)
        self.kv_scheme = KV_SCHEMES[kv_quant](fmt) if KV_SCHEMES[kv_quant] else None
        self._group_amax: dict[str, float] = {}

    def _scheme_of(self, unit: Unit) -> Plain:
        return self.scheme if unit.linear and unit.quantized else self.plain

    # -- planning ----------------------------------------------------------------------------------

    def _src(self, unit: Unit, src: str, suffix: str = ".weight") -> str:
        return src + suffix if unit.linear else src

    def plan(self, rank: int) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict[str, int], dict[str, tuple[int, ...]]]:
        """Per-rank tensors (name → dtype, shape as written: 2-D rows), for vocab-padded ones the bytes actually
        written, and the shapes stored for expert stacks ([E, rows / E, ...])."""
        tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        expected: dict[str, int] = {}
        stacked: dict[str, tuple[int, ...]] = {}
        for unit in self.units:
            if self._hf_stack(unit):
                planned, shapes = self._plan_hf_stack(unit)
                tensors.update(planned)
                stacked.update(shapes)
                continue
            shapes = [self.ckpt.shape(self._src(unit, s)) for s in unit.sources]
            rows = sum(s[0] for s in shapes) if unit.split != "qkv" else None
            rows = out_rows(unit, shapes[0][0] if rows is None else rows, self.cfg, self.tp)
            rest = shapes[0][1:]
            if unit.split == "row":  # a rank's columns; an expert stack's padded to expert_width (shard_rules.py)
                rest = (shard_rules.expert_width(self.cfg.intermediate_size, self.tp) if unit.experts else rest[0] // self.tp,)
            name = unit.out + ".weight" if unit.linear else unit.out
            src_dtype = self.ckpt.dtype(self._src(unit, unit.sources[0]))
            planned = self._scheme_of(unit).tensors(unit.out, rows, rest, src_dtype)
            if not unit.linear:  # a norm or an embedding is stored under its own name, not name.weight
                planned = {name: planned.pop(unit.out + ".weight")}
            per_expert = self._per_expert_scale(unit)
            if per_expert:
                planned[per_expert] = (planned[per_expert][0], (unit.experts, 1))
            tensors.update(planned)
            if unit.split == "vocab":
                real = sum(m.n for m in source_rows_to_rank(unit, "", shapes[0][0], self.cfg, self.tp, rank))
                dt, shape = tensors[name]
                expected[name] = real * math.prod(shape[1:]) * dt.itemsize
            if unit.bias:
                brows = rows if unit.split != "row" else shapes[0][0]
                tensors[unit.out + ".bias"] = (self.dtype, (brows,))
                planned[unit.out + ".bias"] = tensors[unit.out + ".bias"]
            # Expert rows beyond a rank's real width are zero padding, never written (the file starts zeroed).
            real = sum(m.n for part in unit.parts for m in source_rows_to_rank(unit, part, 0, self.cfg, self.tp, rank)) \
                if unit.split == "experts" else None
            for n, (dt, shape) in planned.items() if unit.experts else ():
                if shape and shape[0] in (rows, shapes[0][0]) and n.endswith((".weight", ".bias", f".{self.sn.weight}")):
                    stacked[n] = (unit.experts, shape[0] // unit.experts, *shape[1:])
                    if real is not None:
                        expected[n] = real * math.prod(shape[1:]) * dt.itemsize
        if self.kv_scheme is not None:
            for kv in self.kv_units:
                tensors.update(self.kv_scheme.tensors(kv))
        return tensors, expected, stacked

    # -- ModelOpt's HF layout of a fused expert stack (gpt-oss) ---------------------------------------

    def _hf_stack(self, unit: Unit) -> bool:
        """An expert stack kept whole and quantized as one tensor (checkpoint_formats._layer_units, HF format)."""
        return self.fmt == "hf" and unit.experts > 0 and unit.quantized and self.quant != "none"

    def _plan_hf_stack(self, unit: Unit) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict[str, tuple[int, ...]]]:
        """Its tensors as ModelOpt 0.47's export_hf_checkpoint writes them (docs/research/modelopt-gpt-oss-hf-export.md):
        FP8 `X` [E, in, out] e4m3 + scalar `X_weight_scale`, `X_input_scale`; NVFP4 `X` [E, in/2, out] uint8 (the
        nibbles paired along the inputs), `X_weight_scale` [E, in/16, out] e4m3, scalar `X_weight_scale_2`,
        `X_input_scale`. Planned as 2-D rows (E·rows, out), stored 3-D."""
        E, n_in, n_out = self.ckpt.shape(unit.sources[0])
        x, sn = unit.out, self.sn
        if self.quant == "fp8":
            parts = {x: (torch.float8_e4m3fn, n_in)}
            scalars = (sn.weight, sn.input)
        else:
            parts = {x: (torch.uint8, n_in // 2), f"{x}_{sn.weight}": (torch.float8_e4m3fn, n_in // BLOCK)}
            scalars = (sn.weight_2, sn.input)
        tensors = {n: (dt, (E * rows, n_out)) for n, (dt, rows) in parts.items()}
        tensors.update({f"{x}_{suffix}": (torch.float32, ()) for suffix in scalars})
        return tensors, {n: (E, rows, n_out) for n, (_, rows) in parts.items()}

    def _write_hf_stack(self, writer: SafetensorsWriter, unit: Unit, progress) -> None:
        """One pass over the experts for the stack's amax (one scale for all of them, as ModelOpt's one quantizer per
        tensor), one to encode each expert output-major (blocks along its inputs) and store it transposed back."""
        name, x, sn = unit.sources[0], unit.out, self.sn
        E = self.ckpt.shape(name)[0]
        file = self.ckpt.file_of(name)

        def experts():
            for e in range(E):
                w = self.ckpt.expert_matrix(name, e)  # [out, in]
                yield e, w, check_finite(w, file, name, row_offset=e)

        weight_amax = max(a for _, _, a in experts()) or 1.0  # an all-zero stack quantizes to zeros under any scale
        calib = name.rsplit(".", 1)[0] + (".down" if name.endswith("down_proj") else ".up")
        act = max(self.amax.get(calib, 0.0), self.amax.get(calib[: -len(".up")] + ".gate", 0.0) if calib.endswith(".up") else 0.0)
        if act <= 0.0:
            raise ConfigError(f"calibration recorded no input to {name}'s experts (is the calibration set empty?)", key=f"{self.name}.{calib}")
        per_expert = math.prod(self.ckpt.shape(name)) * max(self.ckpt.dtype(name).itemsize, 1) // E
        if self.quant == "fp8":
            scale = fp8_scale(weight_amax)
            writer.write(f"{x}_{sn.weight}", scale.reshape(()))
            writer.write(f"{x}_{sn.input}", fp8_scale(act).reshape(()))
        else:
            scale = nvfp4_global_scale(weight_amax)
            writer.write(f"{x}_{sn.weight_2}", scale)
            writer.write(f"{x}_{sn.input}", nvfp4_activation_scale(act))
        for e, w, _ in experts():
            self.stats.bytes_read += w.numel() * w.element_size()
            if self.quant == "fp8":  # fp32 quotients: ModelOpt's expert export does not round them to bf16 as its linears' does
                q = quantize_fp8(w, scale)
                writer.write_rows(x, e * w.shape[1], q.t().contiguous())
            else:
                packed, blocks = quantize_nvfp4(w, scale)
                writer.write_rows(x, e * (w.shape[1] // 2), packed.t().contiguous())
                writer.write_rows(f"{x}_{sn.weight}", e * (w.shape[1] // BLOCK), blocks.t().contiguous())
            if progress is not None:
                progress.update(per_expert)

    # -- scales ------------------------------------------------------------------------------------

    def _per_expert_scale(self, unit: Unit) -> str | None:
        """The FP8 weight scale of an expert stack, which TensorRT-LLM's MoE layer holds per expert, shape (E, 1)
        (tensorrt_llm/layers/moe.py `MOEWeightWrapper`); ours is one value for the stack, repeated."""
        if unit.experts and self.fmt == "trtllm" and isinstance(self._scheme_of(unit), Fp8):
            return f"{unit.out}.{self.sn.weight}"
        return None

    def bytes_to_read(self) -> int:
        """What `write` reads in row chunks (the progress bar's total): every source of every unit, as read."""
        names = [self._src(unit, src) for unit in self.units for src in unit.sources]
        return sum(math.prod(self.ckpt.shape(n)) * max(self.ckpt.dtype(n).itemsize, 1) for n in names)

    def _members(self, unit: Unit) -> list[Unit]:
        return [u for u in self.units if unit.group is not None and u.group == unit.group] or [unit]

    def _weight_amax(self, unit: Unit, progress) -> float:
        """Largest |w| over the unit's fusion group (one pass of row chunks over each source). ModelOpt's HF
        export shares it within q/k/v and gate/up for NVFP4 (weight_scale_2) but not for FP8 (weight_scale)."""
        shared = self._scheme_of(unit).shares_weight_amax()
        key = (unit.group if shared else None) or unit.out
        if key not in self._group_amax:
            value = 0.0
            for member in self._members(unit) if shared else [unit]:
                for src in member.sources:
                    name = src + ".weight"
                    for _, _, chunk_amax in self._chunks(name):
                        value = max(value, chunk_amax)
            if value == 0.0:
                value = 1.0  # an all-zero weight quantizes to zeros under any positive scale
            self._group_amax[key] = value
        return self._group_amax[key]

    def _act_amax(self, unit: Unit) -> float:
        value = max((self.amax.get(src, 0.0) for m in self._members(unit) for src in m.sources), default=0.0)
        if value <= 0.0:
            raise ConfigError(
                f"calibration recorded no input to {', '.join(unit.sources)} (is the calibration set empty?)",
                key=f"{self.name}.{unit.sources[0]}",
            )
        return value

    # -- reading -----------------------------------------------------------------------------------

    def _chunks(self, name: str):
        """(first row, row chunk, max |value| of the chunk) over tensor `name`, each chunk checked finite (chunks sized
        for their fp32 width: quantization widens them)."""
        fp32_row = math.prod(self.ckpt.shape(name)[1:]) * 4
        for a, chunk in self.ckpt.row_chunks(name, bytes_per_row=fp32_row):
            yield a, chunk, check_finite(chunk, self.ckpt.file_of(name), name, row_offset=a)

    # -- writing -----------------------------------------------------------------------------------

    def _write_chunk(self, writers: list[SafetensorsWriter], unit: Unit, scheme: Plain, out_w: str, maps: list, first: int,
                     data: torch.Tensor, blocks: torch.Tensor | None, columns: int | None) -> None:
        """Encoded source rows [first, first + len(data)) of one source (and their block scales) into every rank's
        shard: the rows each rank's row maps take, and for row-parallel weights that rank's columns."""
        end = first + data.shape[0]
        for r, rank_maps in enumerate(maps):
            for m in rank_maps:
                lo, hi = max(first, m.src_start), min(end, m.src_start + m.n)
                if lo >= hi:
                    continue
                dst = m.dst_start + lo - m.src_start
                rows, block_rows = data[lo - first : hi - first], None if blocks is None else blocks[lo - first : hi - first]
                if unit.split == "row":
                    rows = rows[:, shard_rules.col_slice(columns // scheme.column_divisor, self.tp, r)]
                    if block_rows is not None:
                        block_rows = block_rows[:, shard_rules.col_slice(columns // scheme.block_columns, self.tp, r)]
                writers[r].write_rows(out_w, dst, rows)
                if block_rows is not None:
                    writers[r].write_rows(scheme.block_scale_name(unit.out), dst, block_rows)

    def write(self, writers: list[SafetensorsWriter], progress: Any | None) -> None:
        tp = self.tp
        for unit in self.units:
            if self._hf_stack(unit):
                self._write_hf_stack(writers[0], unit, progress)
                continue
            out_w = unit.out + ".weight" if unit.linear else unit.out
            scheme = self._scheme_of(unit)
            if scheme is not self.plain:
                for suffix, value in scheme.scales(self._weight_amax(unit, progress), self._act_amax(unit)).items():
                    if f"{unit.out}.{suffix}" == self._per_expert_scale(unit):
                        value = value.reshape(1, 1).expand(unit.experts, 1).contiguous()
                    for r in range(tp):
                        writers[r].write(f"{unit.out}.{suffix}", value)
            for part, src in zip(unit.parts, unit.sources):
                name = self._src(unit, src)
                shape = self.ckpt.shape(name)
                maps = [source_rows_to_rank(unit, part, shape[0], self.cfg, tp, r) for r in range(tp)]
                columns = shape[1] if len(shape) > 1 else None
                width = shard_rules.expert_width(self.cfg.intermediate_size, tp) if unit.experts and unit.split == "row" else None
                for first, chunk, _ in self._chunks(name):
                    self.stats.bytes_read += chunk.numel() * chunk.element_size()
                    if width is not None:  # each rank's slice of the experts' inputs, zero-padded to whole blocks
                        chunk = torch.nn.functional.pad(chunk.view(chunk.shape[0], tp, -1), (0, width - columns // tp)).flatten(1)
                    self._write_chunk(writers, unit, scheme, out_w, maps, first, *scheme.encode(chunk),
                                      columns=columns if width is None else width * tp)
                    if progress is not None:
                        progress.update(chunk.numel() * chunk.element_size())
                if unit.bias:
                    bias = self.ckpt.get(src + ".bias")
                    for r in range(tp):
                        if unit.split == "row":  # added once after the all-reduce: every rank holds it whole
                            writers[r].write(unit.out + ".bias", bias.to(self.dtype))
                            continue
                        for m in maps[r]:
                            writers[r].write_rows(unit.out + ".bias", m.dst_start, bias[m.src_start : m.src_start + m.n].to(self.dtype))
        if self.kv_scheme is not None:
            for kv in self.kv_units:
                k, v = self.amax.get(f"{kv.source}.k_cache", 0.0), self.amax.get(f"{kv.source}.v_cache", 0.0)
                if k <= 0 or v <= 0:
                    raise ConfigError("calibration recorded no K/V for this layer", key=f"{self.name}.{kv.source}")
                for name, value in self.kv_scheme.scales(kv, k, v).items():
                    for r in range(tp):
                        writers[r].write(name, value)


# ----------------------------------------------------------------------------------------------------
# Validation of the sources


def _expected_tensors(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], bool]]:
    return {name: (tuple(t.shape), t.is_floating_point()) for name, t in model.state_dict().items()}


def _check_sources(ckpt: SafetensorsCheckpoint, expected: dict[str, tuple[tuple[int, ...], bool]], ignore: set[str] = frozenset()) -> None:
    for name in expected:
        if name not in ckpt:
            raise CheckpointError("required tensor is missing", file=ckpt.directory, key=name)
    for name in ckpt.keys():
        if name not in expected and name not in ignore:
            raise CheckpointError("unexpected tensor (not part of this architecture)", file=ckpt.file_of(name), key=name)
    for name, (shape, floating) in expected.items():
        got = ckpt.shape(name)
        if got != shape:
            raise CheckpointError(f"shape {list(got)} != {list(shape)} expected from config.json", file=ckpt.file_of(name), key=name)
        dtype = ckpt.dtype(name)
        if floating and dtype not in DTYPES.values():
            raise CheckpointError(f"dtype {dtype} is not a float type (expected F32, BF16 or F16)", file=ckpt.file_of(name), key=name)
        if not floating and dtype.is_floating_point:
            raise CheckpointError(f"dtype {dtype} should be an integer type", file=ckpt.file_of(name), key=name)


def _check_tp(cfg: TransformerConfig, tp: int, quant: str) -> None:
    shard_rules.check_tp(
        tp,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        experts=bool(getattr(cfg, "num_experts", 0)),  # an expert stack's rank width is padded (shard_rules.expert_width)
        hidden_size=cfg.hidden_size,
        head_dim=cfg.head_dim,
        path=cfg.path,
        nvfp4=quant == "nvfp4",
    )


def check_conversion(target_dir: str | Path, drafter_dir: str | Path | None, *, fmt: str, quant: str, tp: int) -> tuple[TargetConfig, DrafterConfig | None]:
    """Everything `convert` checks from the two config.json files alone (no weights read): the pair matches, tp shards
    both, NVFP4 widths fit, and for the one engine (`fmt` "engine") the drafter's KV layout is the target's. What
    `dflash-trt build --dry-run` runs on a deployment's models. Returns their configs."""
    t_cfg = load_target_config(target_dir)
    d_cfg: DrafterConfig | None = check_pair(t_cfg, load_drafter_config(drafter_dir)) if drafter_dir is not None else None
    if fmt == "engine":  # one paged KV pool holds the target's layers and the drafter's (docs/engine-path.md)
        for key, have, want in (("num_key_value_heads", d_cfg.num_kv_heads, t_cfg.num_kv_heads), ("head_dim", d_cfg.head_dim, t_cfg.head_dim)):
            if have != want:
                raise ConfigError(f"{have} != the target's {want} ({t_cfg.path}): the one engine's KV pool holds both models' layers",
                                  file=d_cfg.path, key=key)
        # the drafter layers read the model's RoPE tables, sized from the target's config (eagle/model.py:585 @ f0c873f5)
        if d_cfg.max_position_embeddings > t_cfg.max_position_embeddings:
            raise ConfigError(f"{d_cfg.max_position_embeddings} > the target's {t_cfg.max_position_embeddings} ({t_cfg.path}): the "
                              "one engine's drafter layers read the target's RoPE tables", file=d_cfg.path, key="max_position_embeddings")
    for cfg in (t_cfg, d_cfg):
        if cfg is not None:
            _check_tp(cfg, tp, quant)
            if quant == "nvfp4" and cfg.hidden_size % BLOCK:
                raise ConfigError(f"NVFP4 needs hidden_size to be a multiple of {BLOCK}", file=cfg.path, key="hidden_size")
    if t_cfg.num_experts and fmt == "hf" and quant == "nvfp4" and t_cfg.intermediate_size % BLOCK:  # down_proj's inputs (unpadded)
        raise ConfigError(f"NVFP4 needs intermediate_size to be a multiple of {BLOCK} (the experts' down_proj inputs)",
                          file=t_cfg.path, key="intermediate_size")
    return t_cfg, d_cfg


def default_calibration_prompts(tokenizer, samples: int) -> list[list[int]]:
    """The shipped corpus: training-split prompts (code, chat, GSM), never the evaluation sets."""
    from .prompts import load_train_prompts

    per = -(-samples // 3)
    sets = [load_train_prompts(d, per) for d in ("code", "chat", "gsm")]
    texts = [p.text for group in zip(*sets) for p in group][:samples]
    return [encode_prompt(tokenizer, t, chat=True) for t in texts]


# ----------------------------------------------------------------------------------------------------


def convert(
    target_dir: str | Path,
    drafter_dir: str | Path | None,
    out: str | Path,
    *,
    dtype: str = "bf16",
    quant: str = "none",
    kv_cache_quant: str = "none",
    tp: int = 1,
    fmt: str = "trtllm",
    calib_prompts: list[list[int]] | None = None,
    calib_samples: int = 32,
    calib_max_new_tokens: int = 32,
    amax: dict[str, dict[str, float]] | None = None,
    force: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> ConvertStats:
    """Convert; `amax` (the result of quant.calibrate) skips calibration, `calib_prompts` replaces the
    default calibration set. Returns byte counts and timing."""
    from .models.drafter import DFlashDrafter
    from .models.target import TargetModel

    if dtype not in DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r}; expected one of {list(DTYPES)}", key="--dtype")
    if quant not in SCHEMES:
        raise ConfigError(f"unsupported quantization {quant!r}; expected one of {', '.join(SCHEMES)}", key="--quant")
    if kv_cache_quant not in KV_SCHEMES:
        raise ConfigError(f"unsupported KV-cache quantization {kv_cache_quant!r}; expected one of {', '.join(KV_SCHEMES)}",
                          key="--kv-cache-quant")
    if fmt not in FORMATS:
        raise ConfigError(f"unsupported format {fmt!r}; expected one of {list(FORMATS)}", key="--format")
    engine = fmt == "engine"
    if engine and drafter_dir is None:
        raise ConfigError("the one-engine checkpoint holds the target and its DFlash drafter: pass --drafter", key="--drafter")
    fmt = "trtllm" if engine else fmt  # the engine checkpoint is the two TensorRT-LLM parts, merged
    if fmt in ("hf", "speculators") and tp != 1:
        raise ConfigError(f"the {fmt} format is not sharded (frameworks shard it at load time); use --tp 1", key="--tp")
    if fmt == "speculators" and (drafter_dir is None or quant != "none" or kv_cache_quant != "none"):
        raise ConfigError("--format speculators writes the drafter (pass --drafter), unquantized (--quant none, --kv-cache-quant none)",
                          key="--drafter" if drafter_dir is None else "--quant")
    out = Path(out)
    if out.exists() and not force:
        raise ConfigError("output directory already exists (pass --force to overwrite)", file=out)
    out_dtype = DTYPES[dtype]
    t_cfg, d_cfg = check_conversion(target_dir, drafter_dir, fmt="engine" if engine else fmt, quant=quant, tp=tp)
    experts = t_cfg.num_experts > 0
    t_ckpt = Mxfp4Source(target_dir) if is_mxfp4_checkpoint(target_dir) else SafetensorsCheckpoint(target_dir)
    if fmt == "speculators":
        return _write_speculators(t_cfg, d_cfg, t_ckpt, Path(target_dir), Path(drafter_dir), out, dtype, force)
    with torch.device("meta"):
        t_model = TargetModel(t_cfg)
        d_model = DFlashDrafter(d_cfg, len(d_cfg.target_layer_ids) * t_cfg.hidden_size) if d_cfg is not None else None
    _check_sources(t_ckpt, _expected_tensors(t_model), ignore={"lm_head.weight"} if t_cfg.tie_word_embeddings else set())
    d_ckpt = None
    if d_cfg is not None:
        d_ckpt = SafetensorsCheckpoint(drafter_dir)
        extras: set[str] = set()
        if is_speculators_drafter(drafter_dir):  # its t2d / own lm_head checked, then not converted (the target's rows are used)
            speculators_source(d_ckpt, t_cfg)
            extras = set(SPECULATORS_ONLY_TENSORS)
        _check_sources(d_ckpt, _expected_tensors(d_model), ignore=extras)
        if "d2t" in d_ckpt:
            check_d2t_ids(d_ckpt.get("d2t"), t_cfg.vocab_size, drafter_dir)

    if (quant != "none" or kv_cache_quant != "none") and amax is None:
        amax = _calibrate(target_dir, drafter_dir, calib_prompts, calib_samples, calib_max_new_tokens, progress, log)
    amax = amax or {"target": {}, "drafter": {}}

    quantize = quant != "none"
    stats = ConvertStats()
    # gpt-oss's experts reach the TensorRT-LLM writer as 2-D output-major rows (checkpoint_formats.ExpertView)
    t_source = ExpertView(t_ckpt, t_cfg.num_layers) if experts and fmt == "trtllm" else t_ckpt
    jobs = [("target", t_cfg, t_source, *target_units(t_cfg, fmt, quantize))]
    if d_cfg is not None:
        jobs.append(("drafter", d_cfg, d_ckpt, *drafter_units(d_cfg, fmt, quantize)))
    writers_of = {name: _ModelWriter(name, cfg, ckpt, units, kv_units, fmt, out_dtype, quant, kv_cache_quant, tp, amax.get(name, {}), stats)
                  for name, cfg, ckpt, units, kv_units in jobs}
    start = time.perf_counter()
    with atomic_directory(out, force=force) as tmp:
        total = sum(w.bytes_to_read() for w in writers_of.values())
        bar = progress_bar(total=total, unit="B", unit_scale=True, desc=f"convert {quant} tp={tp}", disable=not progress)
        try:
            for name, cfg, ckpt, units, kv_units in jobs:
                writer = writers_of[name]
                sub = tmp / name
                sub.mkdir()
                files = [f"rank{r}.safetensors" for r in range(tp)] if fmt == "trtllm" else ["model.safetensors"]
                writers = []
                try:
                    for r, fname in enumerate(files):
                        tensors, expected, stacked = writer.plan(r)
                        writers.append(SafetensorsWriter(sub / fname, tensors, expected, stored_shapes=stacked))
                    writer.write(writers, bar)
                    for w in writers:
                        w.finish()
                finally:
                    for w in writers:
                        stats.bytes_written += w.bytes_written
                        w.close()
                stats.largest_tensor_bytes = max([stats.largest_tensor_bytes] + [ckpt.nbytes(n) for n in ckpt.keys()])
                _write_config(sub, name, cfg, t_cfg, fmt, out_dtype, tp, quant, kv_cache_quant, target_dir if name == "target" else drafter_dir)
                stats.files += [f"{name}/{f}" for f in files]
        finally:
            bar.close()
        copied = _copy_tokenizer(Path(target_dir), tmp)
        if fmt == "hf":
            _copy_tokenizer(Path(target_dir), tmp / "target")
        if engine:
            stats.files = merge_engine_checkpoint(tmp, tmp)
            if (tmp / "target" / "generation_config.json").is_file():
                shutil.copy2(tmp / "target" / "generation_config.json", tmp / "generation_config.json")
            shutil.rmtree(tmp / "target")
            shutil.rmtree(tmp / "drafter")
        (tmp / "dflash_convert.json").write_text(
            json.dumps(
                {"format": "engine" if engine else fmt, "dtype": dtype, "quant": quant, "kv_cache_quant": kv_cache_quant, "tp": tp,
                 "target": str(Path(target_dir).resolve()), "drafter": str(Path(drafter_dir).resolve()) if drafter_dir else None,
                 "tokenizer_files": copied},
                indent=2,
            )
            + "\n"
        )
    stats.seconds = time.perf_counter() - start
    return stats


def _write_speculators(t_cfg: TargetConfig, d_cfg: DrafterConfig, t_ckpt: SafetensorsCheckpoint, target_dir: Path, drafter_dir: Path,
                       out: Path, dtype: str, force: bool) -> ConvertStats:
    """The drafter in vLLM's speculators format (speculators_format.py): its config.json as speculators' converter
    writes it, z-lab's tensors as they are (in `dtype`), and for a reduced vocabulary the target's lm_head rows of the
    draft tokens plus t2d. The target is not written: vLLM loads it from its own directory (the config names it)."""
    from safetensors.torch import save_file as save_safetensors

    from .checkpoint_formats import STR_DTYPES
    from .models.drafter import DFlashDrafter
    from .speculators_format import draft_vocab_tensors, zlab_as_speculators

    stats = ConvertStats()
    start = time.perf_counter()
    d_ckpt = SafetensorsCheckpoint(drafter_dir)
    if is_speculators_drafter(drafter_dir):
        raise ConfigError("the drafter is in the speculators format already", file=drafter_dir / "config.json", key="speculators_model_type")
    with torch.device("meta"):
        expected = _expected_tensors(DFlashDrafter(d_cfg, len(d_cfg.target_layer_ids) * t_cfg.hidden_size))
    _check_sources(d_ckpt, expected)
    out_dtype = DTYPES[dtype]
    tensors = {n: (t.to(out_dtype) if t.is_floating_point() else t) for n, t in ((n, d_ckpt.get(n)) for n in d_ckpt.keys())}
    if "d2t" in tensors:
        head = t_ckpt.get("model.embed_tokens.weight" if t_cfg.tie_word_embeddings else "lm_head.weight")
        tensors["lm_head.weight"] = head[torch.arange(len(tensors["d2t"])) + tensors["d2t"]].to(out_dtype).contiguous()
        tensors |= draft_vocab_tensors(tensors["d2t"], t_cfg.vocab_size)
    zlab = json.loads((drafter_dir / "config.json").read_text())
    target_raw = json.loads((target_dir / "config.json").read_text())
    raw = zlab_as_speculators(zlab, list(d_cfg.target_layer_ids), t_cfg.vocab_size, d_cfg.draft_vocab_size, str(target_dir),
                              target_raw.get("architectures", []), STR_DTYPES[out_dtype])
    with atomic_directory(out, force=force) as tmp:
        save_safetensors({n: t.contiguous() for n, t in tensors.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        stats.files = ["config.json", "model.safetensors"]
    stats.bytes_written = (out / "model.safetensors").stat().st_size
    stats.bytes_read = sum(d_ckpt.nbytes(n) for n in d_ckpt.keys())
    stats.seconds = time.perf_counter() - start
    return stats


def _calibrate(target_dir, drafter_dir, prompts, samples, max_new_tokens, progress, log) -> dict[str, dict[str, float]]:
    from .kv_cache import pool_pages
    from .quant.calibrate import calibrate

    if prompts is None:
        prompts = default_calibration_prompts(load_tokenizer(target_dir), samples)
    if not prompts:
        raise ConfigError("the calibration set is empty", key="--calib")
    longest = max(len(p) for p in prompts) + max_new_tokens
    backend = load_torch_backend(target_dir, drafter_dir, dtype=torch.float32, num_pages=pool_pages(1, longest, 16), page_size=16)
    log(f"calibrating on {len(prompts)} prompts ({sum(map(len, prompts))} tokens, {max_new_tokens} new tokens each)")
    return calibrate(backend, prompts, max_new_tokens=max_new_tokens, progress=progress)


def _write_config(sub: Path, name: str, cfg, t_cfg: TargetConfig, fmt: str, dtype: torch.dtype, tp: int, quant: str, kv_quant: str, src_dir) -> None:
    if fmt == "trtllm":
        raw = target_config_json(cfg, dtype, tp, quant, kv_quant) if name == "target" else drafter_config_json(cfg, t_cfg, dtype, tp, quant, kv_quant)
        (sub / "config.json").write_text(json.dumps(raw, indent=4) + "\n")
        return
    routers = [f"model.layers.{i}.mlp.router" for i in range(cfg.num_layers)] if name == "target" and getattr(cfg, "num_experts", 0) else []
    raw, hf_quant = quantized_hf_config_json(json.loads((Path(src_dir) / "config.json").read_text()), name == "target", dtype, quant,
                                             kv_quant, routers)
    if hf_quant is not None:
        (sub / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4) + "\n")
    (sub / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    if name == "target" and (Path(src_dir) / "generation_config.json").is_file():
        shutil.copy2(Path(src_dir) / "generation_config.json", sub / "generation_config.json")


def _copy_tokenizer(src: Path, dst: Path) -> list[str]:
    copied = []
    for fname in TOKENIZER_FILES:
        if (src / fname).is_file():
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / fname, dst / fname)
            copied.append(fname)
    return copied


# ----------------------------------------------------------------------------------------------------
# CLI


def cmd_convert(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    calib = None
    if args.calib:
        tokenizer = load_tokenizer(args.target)
        calib = [encode_prompt(tokenizer, t, chat=True) for t in read_prompts(None, args.calib)][: args.calib_samples]
    stats = convert(
        args.target, args.drafter, args.out, dtype=args.dtype, quant=args.quant, kv_cache_quant=args.kv_cache_quant, tp=args.tp,
        fmt=args.format, calib_prompts=calib, calib_samples=args.calib_samples, calib_max_new_tokens=args.calib_max_new_tokens,
        force=args.force, progress=not args.quiet, log=lambda m: print(m, file=sys.stderr),
    )
    rate = stats.bytes_read / stats.seconds / 1e6 if stats.seconds else 0.0
    print(
        f"wrote {args.out}: {', '.join(stats.files)} ({stats.bytes_written / 1e6:.1f} MB from {stats.bytes_read / 1e6:.1f} MB, "
        f"{stats.seconds:.1f}s, {rate:.0f} MB/s)",
        file=sys.stderr,
    )
    return 0


def register_cli(sub) -> None:
    from .flags import HELP_FORMAT, positive_int

    c = sub.add_parser(
        "convert", formatter_class=HELP_FORMAT,
        help="convert a HF target + DFlash drafter to TensorRT-LLM checkpoints (BF16/FP8/NVFP4, TP-sharded) or quantized HF",
    )
    c.add_argument("--target", required=True, help="Hugging Face target directory")
    c.add_argument("--drafter", help="DFlash drafter directory (omit to convert the target alone)")
    c.add_argument("--out", required=True, help="output directory: OUT/target, OUT/drafter, tokenizer files in OUT")
    c.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="dtype of unquantized tensors (default bf16)")
    c.add_argument("--quant", choices=list(SCHEMES), default="none", help="weight + activation quantization of the linears")
    c.add_argument("--kv-cache-quant", choices=list(KV_SCHEMES), default="none", help="KV-cache quantization (FP8 scales from calibration)")
    c.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks (rank{r}.safetensors each)")
    c.add_argument("--format", choices=list(FORMATS), default="trtllm", help="; ".join(f"{k}: {v}" for k, v in FORMATS.items()))
    c.add_argument("--calib", help="calibration prompts: one per line, or .jsonl with 'prompt' (default: the shipped training corpus)")
    c.add_argument("--calib-samples", type=positive_int, default=32, help="calibration prompts used")
    c.add_argument("--calib-max-new-tokens", type=positive_int, default=32, help="tokens decoded per calibration prompt")
    c.add_argument("--force", action="store_true", help="replace an existing --out")
    c.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's choice)")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(func=cmd_convert)

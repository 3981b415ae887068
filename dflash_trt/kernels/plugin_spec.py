"""The TensorRT plugins' contract: names, attributes and tensor order. One source of truth.

Used by the C++ plugins' generator (kernels/aot.py), the TensorRT-LLM engine path
(dflash_trt/trtllm/) and the tests. Shapes use the names in each plugin's docstring.
Index tensors are int32 (TensorRT's index type); caches and pools are updated in place
(the KV-inject outputs alias their cache inputs, IPluginV3OneBuildV2::getAliasedInput).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

NAMESPACE = "dflash"
VERSION = "1"
TARGET_ARCHS = (90, 100, 103)  # H100/H200, B200, B300
H200_SMS = 132
TARGET_PROGRAMS = 2 * H200_SMS  # block attention splits keys until B · nkv · splits reaches this


@dataclass(frozen=True)
class Field:
    name: str
    type: str  # "int32" | "float32": TensorRT PluginFieldType kINT32 / kFLOAT32
    default: int | float


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: str  # symbolic, e.g. "[T, L*2*nkv*hd]"
    dtypes: tuple[str, ...]  # allowed TensorRT dtypes; "=x": same as tensor x


@dataclass(frozen=True)
class PluginSpec:
    name: str
    fields: tuple[Field, ...]
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    aliases: tuple[tuple[int, int], ...] = ()  # (output index, input index) updated in place

    def field(self, name: str) -> Field:
        return next(f for f in self.fields if f.name == name)

    def pack(self, **values) -> list[tuple[str, bytes, str, int]]:
        """Attributes as PluginFieldCollection entries (name, little-endian bytes, type, length), defaults filled in."""
        unknown = set(values) - {f.name for f in self.fields}
        if unknown:
            raise ValueError(f"{self.name}: unknown attribute(s) {sorted(unknown)}")
        out = []
        for f in self.fields:
            v = values.get(f.name, f.default)
            data = struct.pack("<i", int(v)) if f.type == "int32" else struct.pack("<f", float(v))
            out.append((f.name, data, f.type, 1))
        return out

    def unpack(self, fields: list[tuple[str, bytes, str, int]]) -> dict:
        return {name: struct.unpack("<i" if t == "int32" else "<f", data)[0] for name, data, t, _ in fields}


FLOATS = ("float32", "float16", "bfloat16")
KV_INJECT = PluginSpec(
    name="DFlashKVInject",
    fields=(
        Field("num_layers", "int32", 1),
        Field("num_kv_heads", "int32", 1),
        Field("head_dim", "int32", 128),
        Field("eps", "float32", 1e-6),
        Field("k_scale", "float32", 1.0),  # FP8 caches store K / k_scale
        Field("v_scale", "float32", 1.0),
    ),
    inputs=(
        Tensor("kv", "[T, L*2*nkv*hd]", FLOATS),  # the fused context GEMM's output
        Tensor("k_norm_weight", "[L, hd]", ("=kv",)),
        Tensor("cos", "[T, hd]", ("=kv",)),
        Tensor("sin", "[T, hd]", ("=kv",)),
        Tensor("write_slots", "[T]", ("int32",)),
        Tensor("k_cache", "[L, S, nkv, hd]", FLOATS + ("fp8",)),
        Tensor("v_cache", "[L, S, nkv, hd]", ("=k_cache",)),
    ),
    outputs=(Tensor("k_cache_out", "[L, S, nkv, hd]", ("=k_cache",)), Tensor("v_cache_out", "[L, S, nkv, hd]", ("=k_cache",))),
    aliases=((0, 5), (1, 6)),
)
BLOCK_ATTENTION = PluginSpec(
    name="DFlashBlockAttention",
    fields=(
        Field("num_heads", "int32", 32),
        Field("num_kv_heads", "int32", 8),
        Field("head_dim", "int32", 128),
        Field("max_q", "int32", 16),  # the block size: queries per request at most
        Field("causal", "int32", 0),
        Field("window", "int32", 0),  # sliding window; 0: none
        Field("k_scale", "float32", 1.0),  # FP8 pools only
        Field("v_scale", "float32", 1.0),
    ),
    inputs=(
        Tensor("q", "[T, nh, hd]", FLOATS),
        Tensor("k_pool", "[S, nkv, hd]", FLOATS + ("fp8",)),
        Tensor("v_pool", "[S, nkv, hd]", ("=k_pool",)),
        Tensor("kv_slots", "[B, max_kv]", ("int32",)),
        Tensor("q_starts", "[B]", ("int32",)),
        Tensor("q_lens", "[B]", ("int32",)),
        Tensor("kv_lens", "[B]", ("int32",)),
    ),
    outputs=(Tensor("out", "[T, nh*hd]", ("=q",)),),
)
ACCEPT = PluginSpec(
    name="DFlashAccept",
    fields=(Field("max_drafts", "int32", 15),),
    inputs=(
        Tensor("drafts", "[B, K]", ("int32",)),
        Tensor("num_drafts", "[B]", ("int32",)),
        Tensor("target_tokens", "[B, K+1]", ("int32",)),
        Tensor("seq_lens", "[B]", ("int32",)),
    ),
    outputs=(Tensor("accepted", "[B]", ("int32",)), Tensor("bonus", "[B]", ("int32",)), Tensor("new_lens", "[B]", ("int32",))),
)
PLUGINS = {p.name: p for p in (KV_INJECT, BLOCK_ATTENTION, ACCEPT)}


def output_shapes(spec: PluginSpec, input_shapes: list[tuple[int, ...]], **attrs) -> list[tuple[int, ...]]:
    """Output shapes from input shapes: the rule the C++ getOutputShapes implements."""
    if spec is KV_INJECT:
        return [input_shapes[5], input_shapes[6]]
    if spec is BLOCK_ATTENTION:
        T, nh, hd = input_shapes[0]
        return [(T, nh * hd)]
    if spec is ACCEPT:
        B = input_shapes[0][0]
        return [(B,), (B,), (B,)]
    raise KeyError(spec.name)


def block_attention_launch(batch: int, max_kv: int, num_heads: int, num_kv_heads: int, head_dim: int, max_q: int) -> dict:
    """Grids, splits and workspace of one DFlashBlockAttention call (the kernel launcher's rules)."""
    from . import block_attention_kernel as ba

    splits = ba.num_splits(batch, num_kv_heads, max_kv, TARGET_PROGRAMS)
    bm = ba.block_m(max_q, num_heads, num_kv_heads)
    return dict(
        splits=splits,
        block_m=bm,
        keys_per_split=ba.keys_per_split(max_kv, splits),
        partial_grid=(batch, num_kv_heads, splits),
        combine_grid=(batch, num_kv_heads, 1),
        workspace=ba.workspace_bytes(batch, num_kv_heads, splits, bm, head_dim),
    )


def block_attention_max_workspace(max_batch: int, num_heads: int, num_kv_heads: int, head_dim: int, max_q: int) -> int:
    """An upper bound over every batch ≤ max_batch and any key count: B·nkv·splits ≤ max(TARGET_PROGRAMS, B·nkv)."""
    from . import block_attention_kernel as ba

    rows = max(TARGET_PROGRAMS, max_batch * num_kv_heads)
    return ba.workspace_bytes(rows, 1, 1, ba.block_m(max_q, num_heads, num_kv_heads), head_dim)

"""Plain TensorRT network pieces of the engine path (INetworkDefinition calls only).

They take the network and the `tensorrt` module as arguments, so the same code runs under
trtllm-build (tensorrt, inside tensorrt_llm's network) and on CPU against TensorRT-RTX's builder
(tests/test_trtllm.py), whose INetworkDefinition API is the same for these layers.

The drafter's attention is `DrafterAttention`: the torch reference's `DFlashDrafter.inject_context`
and `DrafterLayer`'s attention (models/drafter.py) as TensorRT layers around our plugins, whose
names, attributes and tensor order come from kernels/plugin_spec.py only.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ..kernels import plugin_spec
from ..kernels.plugin_spec import BLOCK_ATTENTION, KV_INJECT, PluginSpec
from . import api

PLUGIN_NAMESPACE = plugin_spec.NAMESPACE
PLUGIN_VERSION = plugin_spec.VERSION

CONTEXT_FEATURES = "dflash_target_features"  # add_context_features' output: [num_tokens, len(target_layer_ids) * H]
DRAFT_TOKEN_IDS = "dflash_draft_token_ids"  # add_draft_token_ids' output: [N] int32

# The inputs DrafterAttention's plugin graph takes (tests/test_trtllm.py builds that graph with these names on
# TensorRT-RTX's builder). Shapes per rank: T = new context rows, N = block tokens over the batch,
# B = sequences, L = drafter layers, S = cache slots, F = feature width. "dtype" is the network's dtype;
# the caches are flat [L, S, nkv, hd] buffers, not TensorRT-LLM's paged pool (docs/engine-path.md, Status).
DRAFTER_INPUTS: dict[str, tuple[str, str]] = {
    "context_features": ("[T, F]", "dtype"),
    "context_cos": ("[T, hd]", "dtype"),  # RoPE of the injected keys (models.layers.Rotary at their positions)
    "context_sin": ("[T, hd]", "dtype"),
    "context_write_slots": ("[T]", "int32"),  # cache slot of each context row
    "block_ids": ("[N]", "int32"),  # [last, mask × k_b] per sequence, concatenated
    "block_cos": ("[N, hd]", "dtype"),
    "block_sin": ("[N, hd]", "dtype"),
    "block_write_slots": ("[N]", "int32"),  # scratch slots of the block's own K/V (after the context)
    "kv_slots": ("[B, max_kv]", "int32"),  # every key of a sequence: context then block
    "q_starts": ("[B]", "int32"),  # first row of each sequence's block in N
    "q_lens": ("[B]", "int32"),
    "kv_lens": ("[B]", "int32"),
    "k_cache": ("[L, S, nkv, hd]", "dtype"),  # updated in place (DFlashKVInject aliases it)
    "v_cache": ("[L, S, nkv, hd]", "dtype"),
}
# Marked outputs of the aliasing chain: whoever runs the graph binds them to the k_cache / v_cache buffers.
CACHE_OUTPUTS = {"k_cache": "k_cache_out", "v_cache": "v_cache_out"}


def plugin_names() -> tuple[str, ...]:
    return tuple(plugin_spec.PLUGINS)


def add_context_features(network: Any, trt: Any, hidden: Sequence[Any], name: str = CONTEXT_FEATURES) -> Any:
    """Concatenate the captured layer outputs ([T, H] each, target_layer_ids order) into [T, L*H] and
    mark it as an output: the drafter's context input (`fc` reads exactly this layout)."""
    layer = network.add_concatenation(list(hidden))
    layer.axis = 1
    out = layer.get_output(0)
    out.name = name
    network.mark_output(out)
    return out


def add_draft_token_ids(network: Any, trt: Any, logits: Any, name: str = DRAFT_TOKEN_IDS) -> Any:
    """Greedy draft tokens: argmax over the vocabulary of logits [N, V] → int32 [N], marked as output.
    Only N ids leave the GPU instead of N×V logits (drafts are greedy, as in z-lab's loop)."""
    top = network.add_topk(logits, api.get("trt.TopKOperation", trt).MAX, 1, 1 << 1)  # axes bitmask: dim 1
    ids = network.add_shuffle(top.get_output(1))  # [N, 1] → [N]
    ids.reshape_dims = (-1,)
    out = ids.get_output(0)
    out.name = name
    network.mark_output(out)
    return out


# -- plugins -----------------------------------------------------------------------------------------


def plugin_fields(trt: Any, spec: PluginSpec, **attrs) -> tuple[Any, list[np.ndarray]]:
    """spec.pack(...) as a PluginFieldCollection of `trt` (tensorrt, or TensorRT-RTX in the CPU test), and the
    arrays it points into: keep them alive until create_plugin has read them."""
    field_type = api.get("trt.PluginFieldType", trt)
    kinds = {"int32": (field_type.INT32, np.int32), "float32": (field_type.FLOAT32, np.float32)}
    arrays, fields = [], []
    for name, data, kind, _ in spec.pack(**attrs):
        trt_kind, np_type = kinds[kind]
        arrays.append(np.frombuffer(data, dtype=np_type).copy())
        fields.append(api.get("trt.PluginField", trt)(name, arrays[-1], trt_kind))
    return api.get("trt.PluginFieldCollection", trt)(fields), arrays


def add_plugin(network: Any, trt: Any, spec: PluginSpec, inputs: Mapping[str, Any], **attrs) -> Any:
    """One of our IPluginV3 layers with `inputs` keyed by the spec's tensor names, passed in the spec's
    order. The plugin library must be loaded first (ctypes or registry.load_library), in trtllm-build's
    process as in every process that deserializes the engine."""
    expected = [t.name for t in spec.inputs]
    if set(inputs) != set(expected):
        raise ValueError(f"{spec.name}: inputs {sorted(inputs)} != the spec's {expected}")
    creator = api.get("trt.get_plugin_registry", trt)().get_creator(spec.name, PLUGIN_VERSION, PLUGIN_NAMESPACE)
    if creator is None:
        raise api.TensorRTUnavailable(
            f"TensorRT has no plugin creator {PLUGIN_NAMESPACE}::{spec.name} v{PLUGIN_VERSION}: load libdflash_plugins.so "
            "first (DFLASH_PLUGIN_LIB, or `dflash-trt build --plugin-lib`)"
        )
    fields, _arrays = plugin_fields(trt, spec, **attrs)
    plugin = creator.create_plugin(spec.name, fields, api.get("trt.TensorRTPhase", trt).BUILD)
    return network.add_plugin_v3([inputs[name] for name in expected], [], plugin)


# -- plain layers --------------------------------------------------------------------------------------


def _constant(network: Any, array: np.ndarray) -> Any:
    return network.add_constant(array.shape, np.ascontiguousarray(array)).get_output(0)


def _elementwise(network: Any, trt: Any, a: Any, b: Any, op: str) -> Any:
    return network.add_elementwise(a, b, getattr(api.get("trt.ElementWiseOperation", trt), op)).get_output(0)


def _reshape(network: Any, x: Any, dims: tuple[int, ...]) -> Any:
    layer = network.add_shuffle(x)
    layer.reshape_dims = dims  # 0 copies the input's dimension, -1 is inferred
    return layer.get_output(0)


def _gather(network: Any, x: Any, indices: Sequence[int], axis: int) -> Any:
    return network.add_gather(x, _constant(network, np.asarray(indices, np.int32)), axis).get_output(0)


def _cast(network: Any, x: Any, dtype: Any) -> Any:
    return network.add_cast(x, dtype).get_output(0)


def add_rms_norm(network: Any, trt: Any, x: Any, weight: Any, eps: float) -> Any:
    """RMSNorm over the last axis as models.layers.RMSNorm: fp32 statistics, cast back, times weight [d]."""
    dt = api.get("trt.DataType", trt)
    rank = len(x.shape)
    x32 = _cast(network, x, dt.FLOAT)
    mean = network.add_reduce(
        _elementwise(network, trt, x32, x32, "PROD"), api.get("trt.ReduceOperation", trt).AVG, 1 << (rank - 1), True
    ).get_output(0)
    root = network.add_unary(
        _elementwise(network, trt, mean, _constant(network, np.full((1,) * rank, eps, np.float32)), "SUM"),
        api.get("trt.UnaryOperation", trt).SQRT,
    ).get_output(0)
    normed = _cast(network, _elementwise(network, trt, x32, root, "DIV"), x.dtype)
    return _elementwise(network, trt, normed, _reshape(network, weight, (1,) * (rank - 1) + (-1,)), "PROD")


def add_rope(network: Any, trt: Any, x: Any, cos: Any, sin: Any) -> Any:
    """x [N, heads, hd], cos/sin [N, hd] → x·cos + rotate_half(x)·sin (models.layers.apply_rope)."""
    hd = x.shape[2]
    halves = _reshape(network, x, (0, 0, 2, hd // 2))  # [N, heads, 2, hd/2]
    first, second = (_gather(network, halves, [i], 2) for i in (0, 1))  # [N, heads, 1, hd/2]
    neg = network.add_unary(second, api.get("trt.UnaryOperation", trt).NEG).get_output(0)
    rotated = network.add_concatenation([neg, first])
    rotated.axis = 2
    rotated = _reshape(network, rotated.get_output(0), (0, 0, hd))
    cos3, sin3 = _reshape(network, cos, (0, 1, hd)), _reshape(network, sin, (0, 1, hd))
    return _elementwise(
        network, trt, _elementwise(network, trt, x, cos3, "PROD"), _elementwise(network, trt, rotated, sin3, "PROD"), "SUM"
    )


def split_qkv(network: Any, x: Any, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[Any, Any]:
    """A fused qkv projection [N, (nh + 2·nkv)·hd] (Q, K, V column blocks) → q [N, nh, hd] and
    kv [N, 2·nkv·hd]: one layer's [k|v, nkv, hd] row, DFlashKVInject's layout."""
    heads = _reshape(network, x, (0, num_heads + 2 * num_kv_heads, head_dim))
    q = _gather(network, heads, range(num_heads), 1)
    kv = _gather(network, heads, range(num_heads, num_heads + 2 * num_kv_heads), 1)
    return q, _reshape(network, kv, (0, -1))


def layer_slots(network: Any, trt: Any, slots: Any, cache: Any, layer: int) -> Any:
    """Slots of layer `layer` in the flattened cache [L·S, nkv, hd]: slots + layer·S (S read from the
    cache's shape, so the backend chooses the pool size)."""
    if layer == 0:
        return slots
    dt = api.get("trt.DataType", trt)
    size = _gather(network, network.add_shape(cache).get_output(0), [1], 0)  # [1]: S
    offset = _elementwise(network, trt, _cast(network, size, dt.INT32), _constant(network, np.array([layer], np.int32)), "PROD")
    return _elementwise(network, trt, slots, _reshape(network, offset, (1,) * len(slots.shape)), "SUM")


class DrafterAttention:
    """The drafter's paged attention in one engine call, over caches the backend owns.

    `inject_context` is DFlashDrafter.inject_context after the GEMM: every layer's context K/V
    ([T, L·2·nkv·hd]) go through one DFlashKVInject into k_cache/v_cache [L, S, nkv, hd]. `layer(i, ...)`
    is DrafterLayer's attention: q_norm + RoPE on the queries (plain layers), the block's own K/V
    written at block_write_slots by a DFlashKVInject (k_norm, RoPE, scatter: the same epilogue), then
    DFlashBlockAttention over layer i of the caches, seen as one pool [L·S, nkv, hd] with slots + i·S.

    KVInject writes all L layers from one row, so a block row for layer i is layer i's K/V repeated L
    times: the other layers' block slots get values that are either already consumed (layers < i) or
    overwritten by their own layer before they are read (layers > i); block slots are scratch anyway
    (the backend drops them, like the torch backend's set_length rollback).

    Every KVInject consumes the previous one's aliased outputs, so TensorRT orders the writes; the
    chain's end is marked as CACHE_OUTPUTS, which the backend binds to the input buffers.
    """

    def __init__(self, network: Any, trt: Any, inputs: Mapping[str, Any], k_norm_weights: Sequence[Any], *,
                 num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, eps: float):
        missing = set(DRAFTER_INPUTS) - set(inputs)
        if missing:
            raise ValueError(f"drafter inputs missing: {sorted(missing)}")
        self.network, self.trt, self.inputs = network, trt, inputs
        self.num_layers = len(k_norm_weights)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.eps = block_size, eps
        stacked = network.add_concatenation([_reshape(network, w, (1, -1)) for w in k_norm_weights])
        stacked.axis = 0
        self.k_norm_weight = stacked.get_output(0)  # [L, hd]
        self.k_cache, self.v_cache = inputs["k_cache"], inputs["v_cache"]

    def _inject(self, kv: Any, cos: Any, sin: Any, write_slots: Any) -> None:
        layer = add_plugin(
            self.network, self.trt, KV_INJECT,
            {"kv": kv, "k_norm_weight": self.k_norm_weight, "cos": cos, "sin": sin, "write_slots": write_slots,
             "k_cache": self.k_cache, "v_cache": self.v_cache},
            num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, eps=self.eps,
        )
        (k_out, _), (v_out, _) = KV_INJECT.aliases
        self.k_cache, self.v_cache = layer.get_output(k_out), layer.get_output(v_out)

    def inject_context(self, layer_qkv: Sequence[Any]) -> None:
        """layer_qkv: every layer's fused qkv projection of the context [T, (nh + 2·nkv)·hd], layer order."""
        kvs = [split_qkv(self.network, x, self.num_heads, self.num_kv_heads, self.head_dim)[1] for x in layer_qkv]
        kv = self.network.add_concatenation(kvs)
        kv.axis = 1
        i = self.inputs
        self._inject(kv.get_output(0), i["context_cos"], i["context_sin"], i["context_write_slots"])

    def layer(self, index: int, qkv: Any, q_norm_weight: Any, causal: bool, window: int | None) -> Any:
        """Layer `index`'s attention of the block: qkv [N, (nh + 2·nkv)·hd] → the DFlashBlockAttention layer
        (output 0: [N, nh·hd])."""
        net, trt, i = self.network, self.trt, self.inputs
        q, kv = split_qkv(net, qkv, self.num_heads, self.num_kv_heads, self.head_dim)
        q = add_rope(net, trt, add_rms_norm(net, trt, q, q_norm_weight, self.eps), i["block_cos"], i["block_sin"])
        every_layer = net.add_concatenation([kv] * self.num_layers)
        every_layer.axis = 1
        self._inject(every_layer.get_output(0), i["block_cos"], i["block_sin"], i["block_write_slots"])
        pool_dims = (-1, self.num_kv_heads, self.head_dim)
        attn = add_plugin(
            net, trt, BLOCK_ATTENTION,
            {"q": q, "k_pool": _reshape(net, self.k_cache, pool_dims), "v_pool": _reshape(net, self.v_cache, pool_dims),
             "kv_slots": layer_slots(net, trt, i["kv_slots"], self.k_cache, index),
             "q_starts": i["q_starts"], "q_lens": i["q_lens"], "kv_lens": i["kv_lens"]},
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, max_q=self.block_size,
            causal=int(causal), window=window or 0,
        )
        return attn

    def mark_caches(self) -> None:
        for tensor, name in ((self.k_cache, CACHE_OUTPUTS["k_cache"]), (self.v_cache, CACHE_OUTPUTS["v_cache"])):
            tensor.name = name
            self.network.mark_output(tensor)

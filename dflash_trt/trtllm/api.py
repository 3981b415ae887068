"""Every tensorrt / tensorrt_llm name dflash-trt uses, in one place, resolved lazily.

Code in this package never writes `import tensorrt_llm`; it calls `api.get("ColumnLinear")`, so the
set of upstream names we depend on is exactly `NAMES`. Each one is recorded, with the source file and
commit where its signature was read, in `api_snapshot.json`; tests/test_trtllm.py checks that every
`api.get(...)` literal in dflash_trt/trtllm is in `NAMES`, and every `NAMES` entry in the snapshot.

`NAMES`: short name → dotted path ("module:attribute.path"). Members we call on instances of these
classes are listed in `MEMBERS` (class short name → member names) and snapshotted the same way.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from ..errors import DFlashError

SNAPSHOT = Path(__file__).with_name("api_snapshot.json")

NAMES: dict[str, str] = {
    # -- build time: model definitions (tensorrt_llm/models, layers, functional) -------------------
    "MODEL_MAP": "tensorrt_llm.models:MODEL_MAP",
    "PretrainedConfig": "tensorrt_llm.models.modeling_utils:PretrainedConfig",
    "PretrainedModel": "tensorrt_llm.models.modeling_utils:PretrainedModel",
    "Module": "tensorrt_llm.module:Module",
    "ModuleList": "tensorrt_llm.module:ModuleList",
    "Embedding": "tensorrt_llm.layers:Embedding",
    "ColumnLinear": "tensorrt_llm.layers:ColumnLinear",
    "RowLinear": "tensorrt_llm.layers:RowLinear",
    "RmsNorm": "tensorrt_llm.layers:RmsNorm",
    "GatedMLP": "tensorrt_llm.layers:GatedMLP",
    "Tensor": "tensorrt_llm.functional:Tensor",
    "concat": "tensorrt_llm.functional:concat",
    "_create_tensor": "tensorrt_llm.functional:_create_tensor",
    "default_trtnet": "tensorrt_llm._common:default_trtnet",
    "pad_vocab_size": "tensorrt_llm._utils:pad_vocab_size",
    "build_main": "tensorrt_llm.commands.build:main",
    # -- the one engine's network (engine_network.py) -------------------------------------------------------
    "LLaMAForCausalLM": "tensorrt_llm.models.llama.model:LLaMAForCausalLM",
    "LLaMADecoderLayer": "tensorrt_llm.models.llama.model:LLaMADecoderLayer",
    "DecoderLayerList": "tensorrt_llm.models.modeling_utils:DecoderLayerList",
    "GenerationMixin": "tensorrt_llm.models.generation_mixin:GenerationMixin",
    "Attention": "tensorrt_llm.layers.attention:Attention",
    "KeyValueCacheParams": "tensorrt_llm.layers.attention:KeyValueCacheParams",
    "SpecDecodingParams": "tensorrt_llm.layers.attention:SpecDecodingParams",
    "AttentionMaskType": "tensorrt_llm.functional:AttentionMaskType",
    "LayerNormType": "tensorrt_llm.functional:LayerNormType",
    "PositionEmbeddingType": "tensorrt_llm.functional:PositionEmbeddingType",
    "KVCacheType": "tensorrt_llm.llmapi.kv_cache_type:KVCacheType",
    "default_net": "tensorrt_llm._common:default_net",
    "Parameter": "tensorrt_llm.parameter:Parameter",
    "TreeParams": "tensorrt_llm.models.eagle.model:TreeParams",
    "eagle_sample_and_accept_draft_plugin": "tensorrt_llm.models.eagle.model:eagle_sample_and_accept_draft_plugin",
    "eagle_prepare_drafter_inputs_plugin": "tensorrt_llm.models.eagle.model:eagle_prepare_drafter_inputs_plugin",
    "add": "tensorrt_llm.functional:add",
    "mul": "tensorrt_llm.functional:mul",
    "argmax": "tensorrt_llm.functional:argmax",
    "cast": "tensorrt_llm.functional:cast",
    "constant": "tensorrt_llm.functional:constant",
    "expand": "tensorrt_llm.functional:expand",
    "gather": "tensorrt_llm.functional:gather",
    "index_select": "tensorrt_llm.functional:index_select",
    "shape": "tensorrt_llm.functional:shape",
    "slice": "tensorrt_llm.functional:slice",
    "unsqueeze": "tensorrt_llm.functional:unsqueeze",
    "view": "tensorrt_llm.functional:view",
    "Builder": "tensorrt_llm.builder:Builder",
    # -- run time: the executor (DecodingMode::Eagle drives the one engine; executor.py) ---------------------
    "Executor": "tensorrt_llm.bindings.executor:Executor",
    "ExecutorConfig": "tensorrt_llm.bindings.executor:ExecutorConfig",
    "ModelType": "tensorrt_llm.bindings.executor:ModelType",
    "DecodingConfig": "tensorrt_llm.bindings.executor:DecodingConfig",
    "DecodingMode": "tensorrt_llm.bindings.executor:DecodingMode",
    "EagleConfig": "tensorrt_llm.bindings.executor:EagleConfig",
    "Request": "tensorrt_llm.bindings.executor:Request",
    "SamplingConfig": "tensorrt_llm.bindings.executor:SamplingConfig",
    "OutputConfig": "tensorrt_llm.bindings.executor:OutputConfig",
    # -- plain TensorRT (also in tensorrt_rtx, the CPU check) ----------------------------------------
    "trt": "tensorrt:",
    "trt.get_plugin_registry": "tensorrt:get_plugin_registry",
    "trt.PluginField": "tensorrt:PluginField",
    "trt.PluginFieldCollection": "tensorrt:PluginFieldCollection",
    "trt.PluginFieldType": "tensorrt:PluginFieldType",
    "trt.TensorRTPhase": "tensorrt:TensorRTPhase",
    "trt.TopKOperation": "tensorrt:TopKOperation",
    "trt.ElementWiseOperation": "tensorrt:ElementWiseOperation",
    "trt.ReduceOperation": "tensorrt:ReduceOperation",
    "trt.CumulativeOperation": "tensorrt:CumulativeOperation",
    "trt.DataType": "tensorrt:DataType",
    "trt.UnaryOperation": "tensorrt:UnaryOperation",
    "trt.PreviewFeature": "tensorrt:PreviewFeature",
}

# Members called on instances (what the AST scan cannot type-track is at least pinned here).
MEMBERS: dict[str, tuple[str, ...]] = {
    "Executor": ("enqueue_requests", "await_responses", "shutdown"),
    "Response": ("has_error", "error_msg", "request_id", "result"),
    "Result": ("is_final", "output_token_ids"),
    "PretrainedModel": ("from_checkpoint", "__post_init__"),
    "GenerationMixin": ("default_range", "has_ctx_gen_opt_profiles", "get_profiles_ranges"),
    "Attention": ("forward",),
    "LLaMADecoderLayer": ("forward",),
    "Tensor": ("mark_output", "trt_tensor", "view"),
    "MODEL_MAP": ("__setitem__", "__getitem__"),
    "INetworkDefinition": (
        "add_input", "add_topk", "add_shuffle", "add_concatenation", "add_elementwise", "add_cast", "add_cumulative", "add_reduce",
        "add_gather", "add_constant", "add_identity", "add_plugin_v3", "mark_output", "add_unary", "add_shape",
    ),
    "IPluginRegistry": ("get_creator", "load_library"),
    "IPluginCreatorV3One": ("create_plugin",),
    "Builder": ("create_builder_config",),
    "IBuilderConfig": ("set_preview_feature",),
}


class TensorRTUnavailable(DFlashError):
    """tensorrt / tensorrt_llm is not importable here: the engine path needs an NVIDIA GPU machine
    with TensorRT-LLM (e.g. the NGC release image, docker/Dockerfile)."""


def get(name: str, trt_module: Any = None) -> Any:
    """The object behind `NAMES[name]`. `trt_module` replaces the `tensorrt` module for "trt.*" names
    (tensorrt_rtx in the CPU check: the same INetworkDefinition API)."""
    if name not in NAMES:
        raise KeyError(f"{name!r} is not in dflash_trt.trtllm.api.NAMES; add it there and to api_snapshot.json")
    module_name, _, attr = NAMES[name].partition(":")
    if trt_module is not None and module_name == "tensorrt":
        obj = trt_module
    else:
        try:
            obj = importlib.import_module(module_name)
        except ImportError as e:
            raise TensorRTUnavailable(
                f"cannot import {module_name} ({e}); the TensorRT-LLM engine path runs where tensorrt_llm is installed "
                "(NVIDIA GPU + the NGC TensorRT-LLM image: see docker/README.md)"
            ) from None
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


def require_tensorrt_llm() -> None:
    """Fail early and clearly when tensorrt_llm is missing, or is a release without the engine path."""
    from . import TENSORRT_LLM_VERSION, RELEASE_IMAGE

    get("Executor")
    version = str(getattr(importlib.import_module("tensorrt_llm"), "__version__", "unknown"))
    if version.split(".")[:2] != TENSORRT_LLM_VERSION.split(".")[:2]:
        raise TensorRTUnavailable(
            f"tensorrt_llm {version} is installed; the engine path is pinned to {TENSORRT_LLM_VERSION} (the 1.2.x line, "
            f"the last with trtllm-build and the C++ executor): use {RELEASE_IMAGE} (docker/Dockerfile)"
        )


def snapshot() -> dict[str, Any]:
    return json.loads(SNAPSHOT.read_text())

"""tensorrt_llm model definitions for trtllm-build: the one engine on EAGLE's contract (docs/engine-path.md).

What exists: the checkpoint it reads (`dflash-trt convert --format engine`: DFlashForCausalLM, the target's
tensors plus the drafter's under `drafter.`, the drafter's config as `eagle_net_config`,
checkpoint_formats.engine_config_json) and `decoder_layer_feature`, the feature capture its target loop uses.
The DFlashForCausalLM network itself (target → accept → KV injection into the drafter layers of the same paged
pool → block pass) is engine_network.py, which engine_build puts into MODEL_MAP after `register` checked the checkpoint (never executed here: tensorrt_llm
does not install on CPU machines). The two-engine classes that used to be
here (a capturing target and a separate drafter over flat caches) are gone with that design (docs/engine-path.md,
"Why not two engines").

tensorrt_llm is imported only when these functions run (inside trtllm-build's process).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ConfigError, DFlashError


class EngineNetworkUnavailable(DFlashError):
    """A checkpoint the DFlashForCausalLM network does not wire (engine_network.py says which)."""


def decoder_layer_feature(output: Any, use_cache: bool) -> Any:
    """The residual stream after a TensorRT-LLM decoder layer (DFlash's feature: hidden + residual), from what
    the layer returns. Llama's layer (models/llama/model.py `LLaMADecoderLayer.forward`, docs/engine-path.md)
    returns `(hidden, presents)` with the KV cache on, else `hidden`; with `reduce_fusion` or
    `norm_quant_fusion` on, a layer other than the last returns, as `hidden`, the pair `(next layer's normed
    input, residual)` (the normed input being `(fp4, scale)` under NVFP4): the residual stream is then the
    pair's second element, not its first."""
    hidden = output[0] if use_cache else output
    if isinstance(hidden, tuple):
        return hidden[1]
    return hidden


def register(checkpoint_dir: str | Path) -> None:
    """What `engine_build` runs first: refuses a checkpoint of another layout, naming it (before anything of
    tensorrt_llm); engine_build then puts engine_network's DFlashForCausalLM into MODEL_MAP."""
    from ..checkpoint_formats import ENGINE_ARCHITECTURE

    path = Path(checkpoint_dir) / "config.json"
    try:
        arch = json.loads(path.read_text()).get("architecture")
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read the checkpoint's config ({e})", file=path) from None
    if arch != ENGINE_ARCHITECTURE:
        raise ConfigError(f"expected the one-engine checkpoint ({ENGINE_ARCHITECTURE}, `dflash-trt convert --format engine`), got {arch!r}",
                          file=path, key="architecture")

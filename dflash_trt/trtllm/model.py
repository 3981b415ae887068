"""tensorrt_llm model definitions for trtllm-build (design: docs/engine-path.md, two engines).

- `capturing_target_class(base, target_layer_ids)`: the stock Llama / Qwen3 engine class, plus one
  output, `dflash_target_features` [num_tokens, L*H]: the outputs of decoder layers `target_layer_ids`
  (after the residual add: hidden + residual, what z-lab and TensorRT-LLM's PyTorch DFlash capture),
  concatenated in that order. Weights, quantization (FP8 / NVFP4 via TensorRT-LLM's own layers, swapped
  in by PretrainedModel.__post_init__) and TP are the base class's, untouched.
- `drafter_class()`: DFlashDraftForCausalLM, registered in MODEL_MAP under
  trtllm_format.TRTLLM_DRAFTER_ARCHITECTURE, reading exactly the converter's drafter checkpoint
  (transformer.layers.{i}.attention.qkv|dense|q_layernorm|k_layernorm, mlp.fc|gate|proj,
  input_layernorm, post_layernorm, transformer.ln_f, transformer.fc, transformer.hidden_norm) plus the
  target's transformer.vocab_embedding and lm_head (shared, as in every DFlash drafter), taken from the
  same rank of the target checkpoint at load time. Attention is network.DrafterAttention over our plugins
  (kernels/plugin_spec.py): DFlashKVInject writes every layer's context K/V into the caches, then per
  layer the block's own K/V, and DFlashBlockAttention runs the block [last, mask × K] over them. The
  caches k_cache/v_cache [L, S, nkv, hd] are engine inputs that the backend owns and keeps across
  calls (updated in place). Draft ids leave as int32 (argmax).

tensorrt_llm is imported only when these functions run (inside trtllm-build's process).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

from . import api, network


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


def capturing_target_class(base: type, target_layer_ids: list[int]) -> type:
    """`base` (MODEL_MAP's class for the target architecture) with the captured features as an output."""
    trt = api.get("trt")
    layer_ids = list(target_layer_ids)

    class DFlashCapturingTarget(base):  # type: ignore[misc, valid-type]
        def __init__(self, config):
            super().__init__(config)
            if config.mapping.pp_size != 1:
                raise ValueError("DFlash feature capture supports pp_size == 1 only")
            self._captured: dict[int, Any] = {}
            for i in layer_ids:
                layer = self.transformer.layers[i]
                layer_forward = layer.forward

                def capture(*args, _i=i, _forward=layer_forward, **kwargs):
                    out = _forward(*args, **kwargs)
                    self._captured[_i] = decoder_layer_feature(out, bool(kwargs.get("use_cache", False)))
                    return out

                layer.forward = capture

        def forward(self, *args, **kwargs):
            self._captured.clear()
            out = super().forward(*args, **kwargs)
            hidden = [self._captured[i].trt_tensor for i in layer_ids]
            network.add_context_features(api.get("default_trtnet")(), trt, hidden)
            return out

    DFlashCapturingTarget.__name__ = f"DFlashCapturing{base.__name__}"
    return DFlashCapturingTarget


def _shared_target_weights(target_dir: Path, rank: int) -> dict[str, Any]:
    """The target's (vocab-sharded) embedding and lm_head of `rank`: the drafter has neither."""
    from safetensors.torch import safe_open

    with safe_open(str(target_dir / f"rank{rank}.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in ("transformer.vocab_embedding.weight", "lm_head.weight")}


def _drafter_config(target_dir: Path):
    """Our DrafterConfig of the drafter checkpoint next to the target's (causal / window rules, block size)."""
    from ..config import load_drafter_config

    return load_drafter_config(target_dir.parent / "drafter")


def drafter_class(target_checkpoint_dir: str | Path) -> type:
    """DFlashDraftForCausalLM bound to the target checkpoint it shares embedding and lm_head with."""
    PretrainedModel, Module, ModuleList = api.get("PretrainedModel"), api.get("Module"), api.get("ModuleList")
    ColumnLinear, RowLinear, RmsNorm = api.get("ColumnLinear"), api.get("RowLinear"), api.get("RmsNorm")
    GatedMLP, Embedding, Tensor = api.get("GatedMLP"), api.get("Embedding"), api.get("Tensor")
    create_tensor, default_trtnet, pad_vocab_size = api.get("_create_tensor"), api.get("default_trtnet"), api.get("pad_vocab_size")
    trt = api.get("trt")
    target_dir = Path(target_checkpoint_dir)
    rules = _drafter_config(target_dir)

    def heads(config) -> tuple[int, int]:
        tp = config.mapping.tp_size
        return config.num_attention_heads // tp, max(1, config.num_key_value_heads // tp)

    class DraftAttention(Module):
        def __init__(self, config, layer_idx: int):
            super().__init__()
            m, hd = config.mapping, config.head_size
            nh, nkv = heads(config)
            self.layer_idx = layer_idx
            self.qkv = ColumnLinear(config.hidden_size, (nh + 2 * nkv) * hd * m.tp_size, bias=config.attn_bias,
                                    dtype=config.dtype, tp_group=m.tp_group, tp_size=m.tp_size, gather_output=False)
            self.q_layernorm = RmsNorm(hd, eps=config.norm_epsilon, dtype=config.dtype)  # weights only: applied by
            self.k_layernorm = RmsNorm(hd, eps=config.norm_epsilon, dtype=config.dtype)  # DrafterAttention / KVInject
            self.dense = RowLinear(nh * hd * m.tp_size, config.hidden_size, bias=config.attn_bias, dtype=config.dtype,
                                   tp_group=m.tp_group, tp_size=m.tp_size)

        def forward(self, hidden, graph):
            attn = graph.layer(self.layer_idx, self.qkv(hidden).trt_tensor, self.q_layernorm.weight.value.trt_tensor,
                               causal=rules.layer_is_causal(self.layer_idx), window=rules.layer_window(self.layer_idx))
            return self.dense(create_tensor(attn.get_output(0), attn))

    class DraftLayer(Module):
        def __init__(self, config, layer_idx: int):
            super().__init__()
            m = config.mapping
            self.input_layernorm = RmsNorm(config.hidden_size, eps=config.norm_epsilon, dtype=config.dtype)
            self.attention = DraftAttention(config, layer_idx)
            self.post_layernorm = RmsNorm(config.hidden_size, eps=config.norm_epsilon, dtype=config.dtype)
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=config.mlp_bias,
                                dtype=config.dtype, tp_group=m.tp_group, tp_size=m.tp_size, quant_mode=config.quant_mode)

        def forward(self, hidden, graph):
            hidden = hidden + self.attention(self.input_layernorm(hidden), graph)
            return hidden + self.mlp(self.post_layernorm(hidden))

    class DraftTransformer(Module):
        def __init__(self, config):
            super().__init__()
            m = config.mapping
            self.vocab_embedding = Embedding(config.vocab_size, config.hidden_size, dtype=config.dtype, tp_size=m.tp_size,
                                             tp_group=m.tp_group, sharding_dim=0, tp_rank=m.tp_rank)
            self.layers = ModuleList([DraftLayer(config, i) for i in range(config.num_hidden_layers)])
            self.ln_f = RmsNorm(config.hidden_size, eps=config.norm_epsilon, dtype=config.dtype)
            # Replicated on every rank (the converter writes it whole): the context is normed over full H.
            self.fc = ColumnLinear(len(config.target_layer_ids) * config.target_hidden_size, config.hidden_size, bias=False,
                                   dtype=config.dtype, tp_size=1, gather_output=False)
            self.hidden_norm = RmsNorm(config.hidden_size, eps=config.norm_epsilon, dtype=config.dtype)

    class DFlashDraftForCausalLM(PretrainedModel):
        shared_target_dir = target_dir

        def __init__(self, config):
            if getattr(config, "draft_vocab_size", None):
                raise ValueError("drafters with a reduced draft vocabulary (d2t) are not supported by the engine path yet")
            if not config.qk_layernorm:
                raise ValueError("DFlash drafters have per-head q/k norms (qk_layernorm: true); DFlashKVInject always applies k_norm")
            super().__init__(config)
            m = config.mapping
            self.transformer = DraftTransformer(config)
            self.lm_head = ColumnLinear(config.hidden_size, pad_vocab_size(config.vocab_size, m.tp_size), bias=False,
                                        dtype=config.dtype, tp_group=m.tp_group, tp_size=m.tp_size, gather_output=True)

        @classmethod
        def from_checkpoint(cls, ckpt_dir, rank=None, config=None, **kwargs):
            def add_shared(weights: dict) -> dict:
                weights.update(_shared_target_weights(cls.shared_target_dir, config.mapping.rank if config else rank or 0))
                return weights

            return super().from_checkpoint(ckpt_dir, rank, config, preprocess_weights_hook=add_shared)

        def forward(self, **io):
            """DFlashDrafter.inject_context, then the block through every layer (models/drafter.py)."""
            t, c = self.transformer, self.config
            nh, nkv = heads(c)
            net = default_trtnet()
            graph = network.DrafterAttention(
                net, trt, {name: io[name].trt_tensor for name in network.DRAFTER_INPUTS},
                [layer.attention.k_layernorm.weight.value.trt_tensor for layer in t.layers],
                num_heads=nh, num_kv_heads=nkv, head_dim=c.head_size, block_size=rules.block_size, eps=c.norm_epsilon,
            )
            context = t.hidden_norm(t.fc(io["context_features"]))
            graph.inject_context([layer.attention.qkv(context).trt_tensor for layer in t.layers])
            hidden = t.vocab_embedding(io["block_ids"])
            for layer in t.layers:
                hidden = layer(hidden, graph)
            graph.mark_caches()
            logits = self.lm_head(t.ln_f(hidden))
            return network.add_draft_token_ids(net, trt, logits.trt_tensor)

        def prepare_inputs(self, max_batch_size: int, max_num_tokens: int, max_seq_len: int = 0, max_draft_len: int = 0, **kwargs):
            """Engine inputs (network.DRAFTER_INPUTS); one optimization profile. trtllm-build passes more keys: ignored.
            Cache slots S: up to max_batch_size sequences of max_seq_len + one block of scratch each."""
            c = self.config
            _, nkv = heads(c)
            hd, layers = c.head_size, c.num_hidden_layers
            block = max(max_draft_len, rules.block_size - 1) + 1
            block_max = max_batch_size * block
            max_kv = (max_seq_len or c.max_position_embeddings) + block
            widths = {"F": len(c.target_layer_ids) * c.target_hidden_size, "hd": hd}
            dims = {  # name → (upper bound, lower bound)
                "T": (max_num_tokens, 0), "N": (block_max, 1), "B": (max_batch_size, 1), "max_kv": (max_kv, 1),
                "S": (max_batch_size * max_kv, 1),
            }
            i32 = api.get("trt.DataType", trt).INT32
            inputs = {}
            for name, (shape, dtype) in network.DRAFTER_INPUTS.items():
                sizes, ranges = [], OrderedDict()
                for dim in shape.strip("[]").split(", "):
                    if dim in dims:
                        hi, lo = dims[dim]
                        sizes.append(-1)
                        ranges[f"{dim}_{name}" if dim == "max_kv" else dim] = [[lo, (lo + hi) // 2, hi]]
                    else:
                        size = {"L": layers, "nkv": nkv, **widths}[dim]
                        sizes.append(size)
                        ranges[f"{dim}_{name}"] = [[size, size, size]]
                inputs[name] = Tensor(name=name, dtype=i32 if dtype == "int32" else c.dtype, shape=sizes, dim_range=ranges)
            return inputs

    return DFlashDraftForCausalLM


def register(target_checkpoint_dir: str | Path) -> None:
    """Register our classes in tensorrt_llm's MODEL_MAP for this process (what `trtllm_build` runs first):
    the drafter under TRTLLM_DRAFTER_ARCHITECTURE, and the target's architecture replaced by its
    capturing subclass, with the layer ids read from the drafter checkpoint next to it."""
    from ..trtllm_format import TRTLLM_DRAFTER_ARCHITECTURE

    model_map = api.get("MODEL_MAP")
    target_dir = Path(target_checkpoint_dir)
    target_arch = json.loads((target_dir / "config.json").read_text())["architecture"]
    drafter_cfg = json.loads((target_dir.parent / "drafter" / "config.json").read_text())
    model_map[TRTLLM_DRAFTER_ARCHITECTURE] = drafter_class(target_dir)
    model_map[target_arch] = capturing_target_class(model_map[target_arch], drafter_cfg["target_layer_ids"])

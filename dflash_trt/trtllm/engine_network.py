"""DFlashForCausalLM: the one engine's tensorrt_llm network (trtllm-build), on EAGLE's contract (contract.py).

NEVER EXECUTED HERE: tensorrt_llm does not install on this project's machines (docs/engine-path.md, Status). What is
checked on CPU: every upstream name it uses goes through `api.get` (listed in api.NAMES, cited in api_snapshot.json),
and every call to one passes only parameters the cited signature has (tests/test_engine_network.py, an AST scan);
the per-call logic it implements is the one the CPU emulation (emulation.DFlashEngine) runs and the tests compare
with the reference loop. The GPU check (scripts/gpu_engine_check.sh) is what can show it builds and runs.

Per call (line numbers are of the stored `tensorrt_llm/models/eagle/model.py` @ f0c873f5, 1.2.0rc5, unless named):
1. The target over every scheduled token, as `DecoderModelForCausalLM.forward` runs it (it marks `logits`), with
   the decoder layers replaced by `_capturing_layer_class`'s, which keep the residual stream after the layers in
   `target_layer_ids` (model.decoder_layer_feature): the DFlash features, [num_tokens, len(ids) * H].
2. Accept (greedy): the stock `eagle_sample_and_accept_draft_plugin` (46) over the previous drafts, with
   `draft_paths` = our one-path chain, exactly as EagleForCausalLM calls it (793).
3. KV injection: the stock `eagle_prepare_drafter_inputs_plugin` at layer_idx 0 (327; EagleForCausalLM's
   `_prepare_drafter_inputs`, 610-672) gives the rows of the kept tokens (`hidden_states_indices`: the root and the
   accepted drafts, or the whole prompt of a context request) and the layer-0 attention geometry. Their features
   → `fc` → `hidden_norm` → in every drafter layer, that layer's `Attention` in context mode, which writes the
   rows' K (k_layernorm, RoPE) and V into the drafter layer's slots of the paged pool (local_layer_idx =
   num_target_layers + l, EAGLE's layer_idx_offset, 601). Its attention output is not the drafter's (DFlash's queries
   are the block's); one element of it feeds the block pass (×0) so that TensorRT keeps the injection and orders it
   before the block attention that reads the pool (docs/engine-path.md, "Two hazards").
4. One block pass: per request the embeddings of [last accepted token, mask × K] attend (generation mode, spec
   decoding: generation length K + 1, position offsets 0..K, a packed mask of all ones inside the block) to the
   drafter context and to each other; final norm, the draft-vocabulary head, argmax of slots 1..K, d2t →
   `next_draft_tokens` [B, K]; `next_draft_lens` = K; `next_draft_paths` = the chain (contract.chain_paths).

Refused (EngineNetworkUnavailable): T > 0 (the stock accept plugin's sampling is not DFlash's rejection rule;
the executor is built greedy, executor.SAMPLING_UNAVAILABLE), Qwen3 targets (their per-head q/k norms need the
Qwen decoder layer; only the Llama one is wired here), pipeline parallelism.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import numpy as np

from . import api, contract
from .model import EngineNetworkUnavailable, decoder_layer_feature

# Inputs the network declares only to hand them to the stock EAGLE plugins (prepare-inputs, accept): the runtime
# binds them for every EAGLE engine (contract.EAGLE_RUNTIME_INPUTS); the emulation does not model those plugins'
# internals, so contract.INPUTS does not list them.
STOCK_PLUGIN_INPUTS = (
    "posterior_alpha", "posterior_threshold", "host_ctx_eagle_net_request_types", "host_ctx_eagle_net_context_lengths",
    "host_ctx_eagle_net_past_key_value_lengths", "host_gen_eagle_net_request_types", "host_gen_eagle_net_context_lengths",
    "host_gen_eagle_net_past_key_value_lengths", "input_gen_tokens", "chunked_context_next_tokens", "use_dynamic_tree",
)
# The contract inputs this greedy network does not declare (the emulation's exact rejection sampling at T > 0 reads
# it; the stock accept plugin, which this network calls, takes rand_data_validation only).
UNREAD_CONTRACT_INPUTS = ("rand_data_sample",)


def chain_paths_array(k: int) -> np.ndarray:
    """contract.chain_paths' row as numpy, [K+1, K+1] int32: path 0 = 0..K, the rest -1."""
    return contract.chain_paths(contract.Dims(k + 1), 1)[0].numpy()


def block_packed_mask_array(k: int) -> np.ndarray:
    """[K+1, W] int32: every token of the block sees every other (DFlash's block is bidirectional)."""
    return contract.pack_mask(contract.Dims(k + 1), [[True] * (k + 1)] * (k + 1)).numpy()


def _capturing_layer_class(sink: dict):
    """LLaMADecoderLayer that also stores its residual-stream output in `sink[layer_idx]` (graph-build time)."""
    base = api.get("LLaMADecoderLayer")

    class CapturingDecoderLayer(base):
        def forward(self, hidden_states, *args, **kwargs):
            out = super().forward(hidden_states, *args, **kwargs)
            if self.layer_idx in sink["ids"]:  # forward(hidden_states, attention_mask=None, use_cache=False, ...)
                use_cache = kwargs.get("use_cache", args[1] if len(args) > 1 else False)
                sink[self.layer_idx] = decoder_layer_feature(out, use_cache)
            return out

    return CapturingDecoderLayer


def _drafter_modules(cfg: Any, num_target_layers: int, dtype: str, mapping: Any):
    """The drafter's modules under the checkpoint's `drafter.` names (checkpoint_formats.drafter_units):
    transformer.layers.{l}.{input_layernorm, attention.{qkv, q_layernorm, k_layernorm, dense}, post_layernorm,
    mlp.{fc, gate, proj}}, transformer.{fc, hidden_norm, ln_f}, lm_head (the draft vocabulary's rows)."""
    Module, ModuleList = api.get("Module"), api.get("ModuleList")
    Attention, RmsNorm, ColumnLinear, GatedMLP = api.get("Attention"), api.get("RmsNorm"), api.get("ColumnLinear"), api.get("GatedMLP")
    LayerNormType, AttentionMaskType, PositionEmbeddingType = (
        api.get("LayerNormType"), api.get("AttentionMaskType"), api.get("PositionEmbeddingType"))
    hidden, eps = cfg["hidden_size"], cfg["norm_epsilon"]
    tp = dict(tp_group=mapping.tp_group, tp_size=mapping.tp_size)

    class DrafterLayer(Module):
        def __init__(self, index: int):
            super().__init__()
            self.input_layernorm = RmsNorm(normalized_shape=hidden, eps=eps, dtype=dtype)
            self.attention = Attention(
                local_layer_idx=num_target_layers + index, hidden_size=hidden, num_attention_heads=cfg["num_attention_heads"],
                num_kv_heads=cfg["num_key_value_heads"], attention_head_size=cfg["head_size"],
                max_position_embeddings=cfg["max_position_embeddings"], qk_layernorm=True, layernorm_type=LayerNormType.RmsNorm,
                eps=eps, attention_mask_type=AttentionMaskType.causal, bias=cfg.get("attn_bias", False), dtype=dtype,
                position_embedding_type=PositionEmbeddingType.rope_gpt_neox, rotary_embedding_base=cfg["rotary_base"],
                # as LLaMADecoderLayer passes it: the plugin's scale type must match the target's (scaled) RoPE tables
                rotary_embedding_scaling=cfg.get("rotary_scaling"), tp_rank=mapping.tp_rank, **tp)
            self.post_layernorm = RmsNorm(normalized_shape=hidden, eps=eps, dtype=dtype)
            self.mlp = GatedMLP(hidden_size=hidden, ffn_hidden_size=cfg["intermediate_size"], hidden_act="silu",
                                bias=cfg.get("mlp_bias", False), dtype=dtype, **tp)

    class DrafterTransformer(Module):
        def __init__(self):
            super().__init__()
            self.layers = ModuleList([DrafterLayer(i) for i in range(cfg["num_hidden_layers"])])
            width = cfg["target_hidden_size"] * len(cfg["target_layer_ids"])
            self.fc = ColumnLinear(width, hidden, bias=False, dtype=dtype, gather_output=True, **tp)
            self.hidden_norm = RmsNorm(normalized_shape=hidden, eps=eps, dtype=dtype)
            self.ln_f = RmsNorm(normalized_shape=hidden, eps=eps, dtype=dtype)

    class Drafter(Module):
        def __init__(self):
            super().__init__()
            self.transformer = DrafterTransformer()
            self.lm_head = ColumnLinear(hidden, cfg.get("draft_vocab_size") or cfg["vocab_size"], bias=False, dtype=dtype,
                                        gather_output=True, **tp)

    return Drafter()


def dflash_for_causal_lm():
    """The DFlashForCausalLM class (defined when tensorrt_llm imports: inside trtllm-build's process)."""
    concat, index_select, gather, view, slice_ = api.get("concat"), api.get("index_select"), api.get("gather"), api.get("view"), api.get("slice")
    argmax, constant, shape, unsqueeze, expand = api.get("argmax"), api.get("constant"), api.get("shape"), api.get("unsqueeze"), api.get("expand")
    cast, mul, add = api.get("cast"), api.get("mul"), api.get("add")
    LLaMAForCausalLM = api.get("LLaMAForCausalLM")
    DecoderLayerList = api.get("DecoderLayerList")
    Tensor = api.get("Tensor")
    KeyValueCacheParams, SpecDecodingParams = api.get("KeyValueCacheParams"), api.get("SpecDecodingParams")
    accept_plugin = api.get("eagle_sample_and_accept_draft_plugin")
    prepare_plugin = api.get("eagle_prepare_drafter_inputs_plugin")
    TreeParams = api.get("TreeParams")
    GenerationMixin = api.get("GenerationMixin")
    KVCacheType = api.get("KVCacheType")
    default_net = api.get("default_net")
    Parameter = api.get("Parameter")
    DataType = api.get("trt.DataType")

    class DFlashForCausalLM(LLaMAForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            if getattr(config, "qwen_type", None) or getattr(config, "base_architecture", "") == "Qwen3ForCausalLM":
                raise EngineNetworkUnavailable("DFlashForCausalLM: Qwen3 targets need the Qwen decoder layer, which this network "
                                               "does not wire yet (Llama targets only)")
            if config.mapping.pp_size != 1:
                raise EngineNetworkUnavailable("DFlashForCausalLM: pipeline parallelism is refused (the features never cross ranks)")
            drafter = config.eagle_net_config
            self.target_layer_ids = list(drafter["target_layer_ids"])
            self.sink = {"ids": set(self.target_layer_ids)}
            # the same parameters under the same names (transformer.layers.{i}.*), layers that also capture
            self.transformer.layers = DecoderLayerList(_capturing_layer_class(self.sink), config)
            self.max_draft_len = int(config.max_draft_len)
            self.num_eagle_layers = int(config.num_eagle_layers)
            # The layer-0 prepare plugin's row budget, the path length and the runtime's depth check all assume a
            # K-draft chain has K + 1 = num_eagle_layers + 1 path entries (eagleDecodingKernels.cu @ b35ac1b6).
            if self.num_eagle_layers != self.max_draft_len:
                raise EngineNetworkUnavailable(f"DFlashForCausalLM: num_eagle_layers {self.num_eagle_layers} != max_draft_len "
                                               f"{self.max_draft_len} (a one-path chain of K drafts needs num_eagle_layers = K)")
            self.mask_token_id = int(drafter["mask_token_id"])
            self.num_drafter_layers = int(drafter["num_hidden_layers"])
            if drafter.get("causal") or any(t != "full_attention" for t in drafter.get("layer_types") or []):
                raise EngineNetworkUnavailable("DFlashForCausalLM: a causal or sliding-window drafter block is not wired (the block "
                                               "pass's packed mask is all ones, full attention)")
            if drafter.get("rotary_base") != config.rotary_base or drafter.get("rotary_scaling") != config.rotary_scaling:
                raise EngineNetworkUnavailable("DFlashForCausalLM: the drafter's RoPE differs from the target's; the drafter layers "
                                               "use the target's RoPE constants (AttentionParams)")
            # The RoPE tables are the model's, sized from the target's config (Attention.create_attention_const_params,
            # eagle/model.py:585 @ f0c873f5): the drafter's head size must be the target's, its positions within them.
            if drafter.get("head_size") != config.head_size or drafter.get("max_position_embeddings", 0) > config.max_position_embeddings:
                raise EngineNetworkUnavailable(
                    f"DFlashForCausalLM: the drafter's head_size {drafter.get('head_size')} / max_position_embeddings "
                    f"{drafter.get('max_position_embeddings')} do not fit the target's RoPE tables ({config.head_size} / "
                    f"{config.max_position_embeddings})")
            self.drafter = _drafter_modules(drafter, config.num_hidden_layers, config.dtype, config.mapping)
            draft_vocab = drafter.get("draft_vocab_size")
            # draft id i is target id i + d2t[i]: the checkpoint's `drafter.d2t`, loaded as a weight
            self.drafter.d2t = Parameter(shape=(draft_vocab,), dtype="int32") if draft_vocab else None

        # ---- 1. the target, with its features ----------------------------------------------------------------
        def forward(self, *args, **kwargs):
            # as EagleForCausalLM (eagle/model.py:924-925 @ f0c873f5): the injection writes the paged pool, and only with
            # paged KV does DecoderModelForCausalLM.forward return (logits, hidden, all_hidden) (modeling_utils.py:1148 @ b35ac1b6)
            if not (kwargs.get("use_cache") and default_net().plugin_config.paged_kv_cache):
                raise EngineNetworkUnavailable("DFlashForCausalLM needs use_cache and the paged KV cache (--kv_cache_type paged)")
            eagle = {n: kwargs.pop(n, None) for n in (
                "draft_tokens", "draft_lens", "eagle_temperature", "rand_data_validation", "tree_params",
                "host_ctx_eagle_net_request_types", "host_ctx_eagle_net_context_lengths", "host_ctx_eagle_net_past_key_value_lengths",
                "host_gen_eagle_net_request_types", "host_gen_eagle_net_context_lengths", "host_gen_eagle_net_past_key_value_lengths",
                "input_gen_tokens", "chunked_context_next_tokens", "posterior_alpha", "posterior_threshold", "greedy_sampling",
                "use_dynamic_tree")}
            lm_logits, _, _ = super().forward(*args, **kwargs)  # DecoderModelForCausalLM.forward marks 'logits'
            features = concat([self.sink[i] for i in self.target_layer_ids], dim=-1)  # [num_tokens, n_ids * H]
            return self._dflash_step(cast(lm_logits, "float32"), features, kwargs, eagle)

        def _dflash_step(self, lm_logits, features, kwargs, eagle):
            k = self.max_draft_len
            attention_params, kv_cache_params = kwargs["attention_params"], kwargs["kv_cache_params"]
            spec = kwargs["spec_decoding_params"]
            # ---- 2. accept the previous drafts (greedy_sampling = 1: the chain's longest matching prefix) ----
            (accepted_tokens, num_accepted_tokens, accepted_paths, next_draft_tokens, next_draft_lens, next_draft_paths,
             batch_level_starts) = accept_plugin(
                lm_logits, eagle["draft_tokens"], eagle["draft_lens"], eagle["eagle_temperature"], eagle["rand_data_validation"],
                eagle["posterior_alpha"], eagle["posterior_threshold"], eagle["tree_params"], eagle["greedy_sampling"],
                eagle["use_dynamic_tree"])
            # ---- 3. injection geometry: EAGLE's layer-0 drafter inputs ----
            outs = prepare_plugin(
                0, self.num_eagle_layers, 1, attention_params, kwargs["input_ids"], eagle["chunked_context_next_tokens"], accepted_tokens,
                num_accepted_tokens, accepted_paths, next_draft_tokens, next_draft_lens, next_draft_paths, eagle["draft_lens"],
                eagle["tree_params"].paths, batch_level_starts, eagle["input_gen_tokens"], spec.spec_decoding_generation_lengths)
            (seq_len, ctx_len, _, _, _, _, _, rows, _, _, _) = outs
            # the target's AttentionParams (its RoPE constants, filled by DecoderModelForCausalLM.forward) with the
            # layer-0 drafter geometry, as EagleForCausalLM._prepare_drafter_inputs sets it (641-651)
            ctx_attn = copy.copy(attention_params)
            ctx_attn.sequence_length, ctx_attn.context_lengths = seq_len, ctx_len
            ctx_attn.host_request_types = eagle["host_ctx_eagle_net_request_types"]
            ctx_attn.host_context_lengths = eagle["host_ctx_eagle_net_context_lengths"]
            ctx_kv = self._kv_params(kv_cache_params, eagle["host_ctx_eagle_net_past_key_value_lengths"])
            kept = index_select(features, 0, rows)  # the kept tokens' target features
            ctx = self.drafter.transformer.hidden_norm(self.drafter.transformer.fc(kept))
            anchor = None
            for layer in self.drafter.transformer.layers:
                out, _ = layer.attention(ctx, use_cache=True, kv_cache_params=ctx_kv, attention_params=ctx_attn)
                one = slice_(out, [0, 0], [1, 1])  # row 0 is always a real row
                anchor = one if anchor is None else add(anchor, one)
            # ---- 4. the block pass ----
            batch = shape(num_accepted_tokens, 0)
            last_index = unsqueeze(add(num_accepted_tokens, constant(np.array([-1], dtype=np.int32))), 1)
            last = gather(accepted_tokens, 1, last_index)  # [B, 1]: the bonus token, the block's slot 0
            masks = expand(constant(np.full((1, k), self.mask_token_id, dtype=np.int32)), concat([batch, k]))
            block_ids = view(concat([last, masks], dim=1), [-1])  # [B * (K+1)]
            hidden = self.transformer.vocab_embedding(block_ids)  # the target's embedding (DFlash shares it)
            zero = cast(constant(np.zeros((1, 1), dtype=np.float32)), hidden.dtype)
            hidden = add(hidden, mul(cast(anchor, hidden.dtype), zero))  # the injection runs first
            d = k + 1
            gen_lengths = expand(constant(np.array([d], dtype=np.int32)), unsqueeze(batch, 0))
            offsets = expand(constant(np.arange(d, dtype=np.int32)[None]), concat([batch, d]))
            mask_words = block_packed_mask_array(k)
            packed = view(expand(constant(mask_words[None]), concat([batch, d, mask_words.shape[1]])),
                               [-1, mask_words.shape[1]])
            block_spec = SpecDecodingParams(True, d, gen_lengths, offsets, packed, spec.spec_decoding_use)
            # generation mode over the drafter context: past = the injected length, K + 1 new rows (as EagleNetX's
            # layers >= 1 attend, with context_lengths = the layer-0 sequence length, 885-886)
            block_attn = copy.copy(attention_params)
            block_attn.sequence_length = add(seq_len, constant(np.array([d], dtype=np.int32)))
            block_attn.context_lengths = seq_len
            block_attn.host_request_types = eagle["host_gen_eagle_net_request_types"]
            block_attn.host_context_lengths = eagle["host_gen_eagle_net_context_lengths"]
            block_kv = self._kv_params(kv_cache_params, eagle["host_gen_eagle_net_past_key_value_lengths"])
            for layer in self.drafter.transformer.layers:
                residual = hidden
                attn, _ = layer.attention(layer.input_layernorm(hidden), use_cache=True, spec_decoding_params=block_spec,
                                          kv_cache_params=block_kv, attention_params=block_attn)
                hidden = add(residual, attn)
                hidden = add(hidden, layer.mlp(layer.post_layernorm(hidden)))
            hidden = self.drafter.transformer.ln_f(hidden)
            width = self.config.hidden_size
            slots = slice_(view(hidden, concat([batch, d, width])), [0, 1, 0], concat([batch, k, width]))
            logits = self.drafter.lm_head(view(slots, [-1, width]))  # slots 1..K of every block
            best = argmax(logits, dim=-1)  # draft-vocabulary ids, [B * K]
            if self.drafter.d2t is not None:
                best = add(best, index_select(self.drafter.d2t.value, 0, best))
            drafts = view(best, concat([batch, k]))
            lens = expand(constant(np.array([k], dtype=np.int32)), unsqueeze(batch, 0))
            paths = expand(constant(chain_paths_array(k)[None]), concat([batch, d, d]))
            for name, tensor in (("accepted_tokens", accepted_tokens), ("num_accepted_tokens", num_accepted_tokens),
                                 ("accepted_paths", accepted_paths), ("next_draft_tokens", drafts), ("next_draft_lens", lens),
                                 ("next_draft_paths", paths)):
                tensor.mark_output(name)  # no dtype argument, as EagleForCausalLM (889-894)
            return drafts

        @staticmethod
        def _kv_params(kv, host_past_lengths):
            """The pool's tensors with the drafter pass's own host past lengths (DecoderLayerList.forward builds
            one KeyValueCacheParams per layer the same way, modeling_utils.py:654-668 @ b35ac1b6)."""
            return KeyValueCacheParams(
                past_key_value=[None], host_past_key_value_lengths=host_past_lengths,
                host_max_attention_window_sizes=kv.host_max_attention_window_sizes, host_sink_token_length=kv.host_sink_token_length,
                kv_cache_block_offsets=kv.kv_cache_block_offsets, host_kv_cache_block_offsets=kv.host_kv_cache_block_offsets,
                host_kv_cache_pool_pointers=kv.host_kv_cache_pool_pointers, host_kv_cache_pool_mapping=kv.host_kv_cache_pool_mapping,
                cache_indirection=kv.cache_indirection)

        # ---- the engine's inputs: the base model's, with the drafter layers' KV, plus EAGLE's, declared as
        # EagleForCausalLM.prepare_inputs declares them (941-1220: names, dtypes, shapes, dim names and ranges) ----
        def prepare_inputs(self, *args, **kwargs):
            plugins = default_net().plugin_config
            max_batch_size = kwargs["max_batch_size"]
            gt_range = GenerationMixin.default_range(max_batch_size * (self.max_draft_len + 1), min_range=0, opt_offset=1)
            kwargs["speculative_decoding_draft_tokens_external"] = False
            kwargs["max_draft_len"] = self.max_draft_len
            kwargs["spec_decoding_is_generation_length_variable"] = True
            kwargs["num_hidden_layers"] = self.config.num_hidden_layers + self.num_drafter_layers  # the drafter's KV layers
            inputs = super().prepare_inputs(*args, **kwargs)
            kv_cache_type = KVCacheType.PAGED if plugins.paged_kv_cache else KVCacheType.CONTINUOUS
            ctx_gen = GenerationMixin.has_ctx_gen_opt_profiles(
                use_gpt_attention_plugin=plugins.gpt_attention_plugin, use_gemm_plugin=plugins.gemm_plugin,
                remove_input_padding=plugins.remove_input_padding, kv_cache_type=kv_cache_type)
            _, ranges = GenerationMixin.get_profiles_ranges(
                max_batch_size=max_batch_size, max_beam_width=kwargs["max_beam_width"], max_input_len=kwargs["max_input_len"],
                max_num_tokens=kwargs["max_num_tokens"], max_draft_len=self.max_draft_len, opt_batch_size=kwargs.get("opt_batch_size"),
                opt_num_tokens=kwargs.get("opt_num_tokens"), enable_ctx_gen_opt_profiles=ctx_gen,
                multiple_profiles=plugins.multiple_profiles, kv_cache_type=kv_cache_type)
            bb = ranges["bb_range"]
            k, d, p = self.max_draft_len, self.max_draft_len + 1, self.num_eagle_layers + 1
            per_profile = lambda value: [value] * len(bb)  # noqa: E731

            def declare(name, dtype, dims_shape, dims=None):
                if dims is None:
                    return Tensor(name=name, dtype=dtype, shape=dims_shape)
                return Tensor(name=name, dtype=dtype, shape=dims_shape, dim_range=OrderedDict(dims))

            i32, f32 = DataType.INT32, DataType.FLOAT
            batch = [("batch_size", bb)]
            inputs["draft_tokens"] = declare("draft_tokens", i32, [-1, k], batch + [("draft_len", per_profile(k))])
            inputs["draft_lens"] = declare("draft_lens", i32, [-1], batch)
            for name in ("eagle_temperature", "posterior_alpha", "posterior_threshold"):
                inputs[name] = declare(name, f32, [-1], batch)
            inputs["rand_data_validation"] = declare("rand_data_validation", f32, [-1, d], batch + [("decoding_len", per_profile(d))])
            paths = declare("draft_paths", i32, [-1, d, p], batch + [("decoding_len", per_profile(d)), ("path_len", per_profile(p))])
            inputs["tree_params"] = TreeParams(paths=paths)
            for name in ("host_ctx_eagle_net_request_types", "host_ctx_eagle_net_context_lengths",
                         "host_ctx_eagle_net_past_key_value_lengths", "host_gen_eagle_net_request_types",
                         "host_gen_eagle_net_context_lengths", "host_gen_eagle_net_past_key_value_lengths",
                         "chunked_context_next_tokens"):
                inputs[name] = declare(name, i32, [-1], batch)
            inputs["input_gen_tokens"] = declare("input_gen_tokens", i32, [-1], [("gen_tokens", per_profile(gt_range))])
            for name in ("greedy_sampling", "use_dynamic_tree"):
                inputs[name] = declare(name, i32, [1])
            return inputs

    return DFlashForCausalLM
